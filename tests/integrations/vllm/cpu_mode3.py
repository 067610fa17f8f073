"""A CPU stand-in for vLLM's CUDA default, compilation mode 3 (``VLLM_COMPILE``).

vLLM's CPU platform rewrites mode 3 into mode 2 with inductor (``CpuPlatform.check_and_update_config``),
so on CPU vLLM never runs its ``VllmBackend``. `keep_mode_3` wraps that platform hook in the process
that builds the engine config, so the config keeps mode 3; vLLM's workers then compile exactly as on
CUDA minus the CUDA graphs: ``VllmBackend`` (KVPP's subclass) splits the graph at ``splitting_ops``,
compiles each piece with inductor, and runs its generated code with the kvpp ops inline. What only a
GPU shows: the piecewise CUDA-graph capture and replay around the eager pieces.

Two settings the CUDA platform makes and the CPU one does not: ``compile_sizes=[]`` (vLLM's piecewise
backend finds no compile range without it) and ``enable_auto_functionalized_v2`` (vLLM's CUDA-only
``fix_functionalization`` pass names CUDA kernels for every v1 ``auto_functionalized`` node).
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def keep_mode_3(backend: str = "inductor"):
    """While open, configs built in this process that ask for mode 3 keep it, its pieces compiled by
    ``backend``: inductor, as on CUDA, or vLLM's ``"eager"`` (the same split and kvpp ops inline, pieces run
    as traced, without inductor's compile time)."""
    from vllm.config import CompilationMode
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        asked = vllm_config.compilation_config.mode
        original(cls, vllm_config)
        compilation = vllm_config.compilation_config
        if asked == CompilationMode.VLLM_COMPILE:
            compilation.mode = CompilationMode.VLLM_COMPILE
            compilation.backend = backend
            compilation.compile_sizes = []
            compilation.inductor_compile_config["enable_auto_functionalized_v2"] = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = classmethod(original)
