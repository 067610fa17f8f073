"""How KVPP runs under each of vLLM's compilation modes: settings made on the config at ``LLM(...)``.

Invariant: once `configure_compilation` has run on a resolved config, every target layer's attention
runs with the kvpp ops, or the config was refused with a `ValueError` that says what to set:

- mode 0 (``enforce_eager``, and breakable CUDA graphs, which force it): the eager hooks of `worker`;
- modes 1 and 2 (vLLM's CPU default is mode 2 with inductor): ``compilation_config.backend`` becomes
  the kvpp backend, and the backend the user or the platform had chosen compiles the pieces between
  the kvpp and MLA ops (``additional_config.kvpp_fx.inner_backend``);
- mode 3 (``VLLM_COMPILE``, the CUDA default): KVPP workers build vLLM's ``VllmBackend`` as a subclass
  that runs the insert pass on the whole Dynamo graph before vLLM's split (`compilation`), and
  ``splitting_ops`` gains ``kvpp::prefetch`` and ``kvpp::wait``, so they run eagerly between the
  CUDA-graphed pieces. FULL CUDA graphs would capture them: an unchosen FULL_AND_PIECEWISE default is
  lowered to PIECEWISE with one warning (as vLLM does for layer-wise KV connectors); a FULL mode the
  user asked for is refused with the seed's message.

vLLM keys its compile caches (the piece cache of mode 3 and the AOT artifacts of every mode) by the
config hash, ``additional_config`` included. ``additional_config.kvpp_fx.digest`` is the KVPP pass
pipeline's source uuid (`kvpp_fx.passes.sources`, which `PassManager.uuid` hashes too), so pieces or
artifacts compiled by another kvpp-fx never load. This module imports nothing but the standard library
and that plain module: it runs in vLLM's engine process.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from kvpp_fx.passes.sources import source_uuid

logger = logging.getLogger(__name__)

KVPP_BACKEND = "kvpp_fx.integrations.vllm.backend"
KVPP_SPLITTING_OPS = ("kvpp::prefetch", "kvpp::wait")
SETTINGS_KEY = "kvpp_fx"  # additional_config[SETTINGS_KEY]: written by the plugin, read by its workers

# Torch's own Dynamo backends that may compile the pieces in modes 1 and 2 (vLLM's init_backend takes
# these names as they are; anything else is a qualified name of a backend that would see the whole graph).
TORCH_BACKENDS = ("inductor", "eager", "aot_eager", "aot_eager_decomp_partition")

MSG_BACKEND = (
    "KVPP under compilation mode {mode} compiles vLLM's graph with the kvpp backend, and the pieces "
    "between the kvpp and MLA ops with one of torch's backends {torch_backends}; got "
    "compilation_config['backend'] = {got!r}, which would see the whole graph and run attention "
    "without the kvpp ops. Use one of those names, or enforce_eager=True."
)
MSG_DERIVED_FULL = (
    "KVPP supports eager execution or PIECEWISE only. vLLM resolved cudagraph_mode to {mode} from "
    "other settings; set compilation_config={{'cudagraph_mode': 'PIECEWISE'}}."
)
MSG_GRAPH_PARTITION = (
    "KVPP splits vLLM's graph at the kvpp ops with vLLM's FX splitter; set "
    "compilation_config={'use_inductor_graph_partition': False}."
)
MSG_LOWERED = (
    "KVPP: cudagraph_mode FULL_AND_PIECEWISE (vLLM's default) lowered to PIECEWISE: a full CUDA graph "
    "would capture the kvpp broadcasts and waits, which must run between the graphed pieces."
)


@dataclass(frozen=True)
class Requested:
    """What the user asked for, read before vLLM resolves the config (vLLM leaves no trace of it)."""

    cudagraph_mode: str | None  # None: not chosen

    @classmethod
    def of(cls, vllm_config: Any) -> Requested:
        mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
        return cls(None if mode is None else str(getattr(mode, "name", mode)))


@functools.cache
def compile_digest() -> str:
    """The KVPP pipeline's source uuid of this installed kvpp-fx (`kvpp_fx.passes.sources`)."""
    return source_uuid()


def settings(vllm_config: Any) -> dict[str, Any]:
    """``additional_config.kvpp_fx`` of a config KVPP has configured ({} before)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return dict(extra.get(SETTINGS_KEY) or {})


def inner_backend(vllm_config: Any) -> str:
    """The backend that compiles the pieces in modes 1 and 2."""
    return settings(vllm_config).get("inner_backend") or "inductor"


def configure_compilation(vllm_config: Any, requested: Requested) -> None:
    """Make the resolved `vllm_config` run the kvpp ops under its compilation mode (module docstring).

    Idempotent: vLLM resolves copies of a config again (``dataclasses.replace``), and a config this
    function has configured comes back unchanged.
    """
    compilation = vllm_config.compilation_config
    mode = int(compilation.mode or 0)
    ours = settings(vllm_config)
    if mode in (1, 2):
        backend = compilation.backend
        if backend == KVPP_BACKEND:
            inner = ours.get("inner_backend", "inductor")
        elif backend in TORCH_BACKENDS:
            inner = backend
        else:
            raise ValueError(MSG_BACKEND.format(mode=mode, torch_backends=list(TORCH_BACKENDS), got=backend))
        compilation.backend = KVPP_BACKEND
        ours["inner_backend"] = inner
    elif mode == 3:
        if compilation.use_inductor_graph_partition:
            raise ValueError(MSG_GRAPH_PARTITION)
        _lower_full_cudagraphs(compilation, requested)
        ops = list(compilation.splitting_ops or [])
        compilation.splitting_ops = ops + [op for op in KVPP_SPLITTING_OPS if op not in ops]
    ours["digest"] = compile_digest()
    vllm_config.additional_config[SETTINGS_KEY] = ours


def _lower_full_cudagraphs(compilation: Any, requested: Requested) -> None:
    mode = compilation.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return
    if mode.name == "FULL_AND_PIECEWISE" and requested.cudagraph_mode is None:
        logger.warning(MSG_LOWERED)
        compilation.cudagraph_mode = type(mode).PIECEWISE
        return
    raise ValueError(MSG_DERIVED_FULL.format(mode=mode.name))
