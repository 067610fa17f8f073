"""Test-only: make vLLM CPU run its Triton code paths (the V2 model runner, Triton attention kernels)
under Triton's interpreter. Import this module before vLLM, at the top of every entry module whose
processes import vLLM: vLLM's TP workers are spawned and re-run the entry module, not this one."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def register_interpreter_backend() -> None:
    """vLLM CPU enables Triton only when ``"cpu"`` is among Triton's backends
    (``vllm/triton_utils/importing.py``); stock Triton has none, and under ``TRITON_INTERPRET=1`` none is
    needed. The entry only has to exist: nothing instantiates it."""
    import triton.backends as backends

    class _InterpreterOnly:
        @classmethod
        def is_active(cls) -> bool:
            return False

    backends.backends.setdefault("cpu", backends.Backend(compiler=object, driver=_InterpreterOnly))


register_interpreter_backend()
