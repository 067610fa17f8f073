"""How KVPP runs under each of vLLM's compilation modes: settings made on the config at ``LLM(...)``.

Invariant: once `configure_compilation` has run on a resolved config, every target layer's attention
runs with the kvpp ops, or the config was refused with a `ValueError` that says what to set:

- mode 0 (``enforce_eager``): the eager hooks of `worker`. Under breakable CUDA graphs (vLLM's default
  for DeepSeek-V3.2 and GLM-5 class models, which forces mode 0) the hooks record the wait and the MLA
  cache write as eager segments of the capture (`model_hooks`), and vLLM breaks at MLA attention:
  an unchosen FULL_AND_PIECEWISE is lowered to PIECEWISE, since a FULL decode graph would capture
  attention whole;
- modes 1 and 2 (vLLM's CPU default is mode 2 with inductor): ``compilation_config.backend`` becomes
  the kvpp backend, and the backend the user or the platform had chosen compiles the pieces between
  the kvpp and MLA ops (``additional_config.kvpp_fx.inner_backend``). vLLM captures no piecewise graphs
  there (it lowers FULL_AND_PIECEWISE to FULL_DECODE_ONLY), so a FULL mode is refused, saying to set NONE;
- mode 3 (``VLLM_COMPILE``, the CUDA default): KVPP workers build vLLM's ``VllmBackend`` as a subclass
  that runs the insert pass on the whole Dynamo graph before vLLM's split (`compilation`), and
  ``splitting_ops`` gains ``kvpp::prefetch`` and ``kvpp::wait``, so they run eagerly between the
  CUDA-graphed pieces. They also hold vLLM's MLA attention and MLA cache write, which read KVPP's
  per-step tables and slot mapping: a user's list that lacks them gets them (one warning), the
  rope+cache-write fusion that would move the write into a piece is turned off (one warning), and
  attention+quant fusion, which needs attention inside a piece, is refused. FULL CUDA graphs would
  capture all of these: an unchosen FULL_AND_PIECEWISE default is lowered to PIECEWISE with one
  warning (as vLLM does for layer-wise KV connectors); a FULL mode the user asked for is refused with
  the seed's message.

vLLM keys its compile caches (the piece cache of mode 3 and the AOT artifacts of every mode) by the
config hash, ``additional_config`` included. ``additional_config.kvpp_fx.digest`` is the KVPP pass
pipeline's source uuid (`kvpp_fx.passes.sources`: every module the passes import, and the drivers that
configure them), so pieces or artifacts compiled by another kvpp-fx never load. This module imports nothing but the
standard library
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
# vLLM's MLA ops that read KVPP's per-step metadata; vLLM makes both splitting ops only when the user's
# ``splitting_ops`` is None and no attention fusion is on (``CompilationConfig.set_splitting_ops_for_v1``).
MLA_SPLITTING_OPS = ("vllm::unified_mla_attention_with_output", "vllm::unified_mla_kv_cache_update")
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
MSG_NO_PIECEWISE_MODE = (
    "KVPP supports eager execution or PIECEWISE only. Under compilation mode {mode} vLLM captures no "
    "piecewise CUDA graphs and resolved cudagraph_mode to {cudagraph}, which would capture the kvpp ops; "
    "set compilation_config={{'cudagraph_mode': 'NONE'}}, or mode 3 (VLLM_COMPILE) for PIECEWISE graphs."
)
MSG_ATTN_FUSION = (
    "KVPP runs vLLM's MLA attention and MLA cache write eagerly between the graphed pieces (they read "
    "KVPP's per-step block tables and slot mapping); compilation_config.pass_config.fuse_attn_quant "
    "compiles attention into a piece. Set compilation_config={'pass_config': {'fuse_attn_quant': False}}."
)
MSG_ADDED_MLA_OPS = (
    "KVPP: added {ops} to compilation_config.splitting_ops: a piece captured with them would replay "
    "vLLM's slot mapping and block tables instead of KVPP's."
)
MSG_NO_ROPE_CACHE_FUSION = (
    "KVPP: compilation_config.pass_config.fuse_rope_kvcache_cat_mla turned off: it would fuse the MLA "
    "cache write into a graphed piece, which KVPP keeps eager."
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


def configure_compilation(vllm_config: Any, requested: Requested, breakable: bool = False) -> None:
    """Make the resolved `vllm_config` run the kvpp ops under its compilation mode (module docstring).
    `breakable`: whether vLLM captures breakable CUDA graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH``, as vLLM
    resolved it).

    Idempotent: vLLM resolves copies of a config again (``dataclasses.replace``), and a config this
    function has configured comes back unchanged.
    """
    compilation = vllm_config.compilation_config
    mode = int(compilation.mode or 0)
    ours = settings(vllm_config)
    if mode == 0 and breakable:
        _lower_full_cudagraphs(compilation, requested)
    elif mode in (0, 1, 2):
        _refuse_full_cudagraphs(compilation, mode)
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
        _keep_mla_ops_eager(compilation)
        _lower_full_cudagraphs(compilation, requested)
        ops = list(compilation.splitting_ops or [])
        compilation.splitting_ops = ops + [op for op in KVPP_SPLITTING_OPS if op not in ops]
    ours["digest"] = compile_digest()
    vllm_config.additional_config[SETTINGS_KEY] = ours


def _keep_mla_ops_eager(compilation: Any) -> None:
    passes = compilation.pass_config
    if passes.fuse_attn_quant:
        raise ValueError(MSG_ATTN_FUSION)
    if passes.fuse_rope_kvcache_cat_mla:
        logger.warning(MSG_NO_ROPE_CACHE_FUSION)
        passes.fuse_rope_kvcache_cat_mla = False
    ops = list(compilation.splitting_ops or [])
    missing = [op for op in MLA_SPLITTING_OPS if op not in ops]
    if missing:
        logger.warning(MSG_ADDED_MLA_OPS.format(ops=missing))
        compilation.splitting_ops = ops + missing


def _refuse_full_cudagraphs(compilation: Any, mode: int) -> None:
    cudagraph = compilation.cudagraph_mode
    if cudagraph is not None and cudagraph.has_full_cudagraphs():
        raise ValueError(MSG_NO_PIECEWISE_MODE.format(mode=mode, cudagraph=cudagraph.name))


def _lower_full_cudagraphs(compilation: Any, requested: Requested) -> None:
    mode = compilation.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return
    if mode.name == "FULL_AND_PIECEWISE" and requested.cudagraph_mode is None:
        logger.warning(MSG_LOWERED)
        compilation.cudagraph_mode = type(mode).PIECEWISE
        return
    raise ValueError(MSG_DERIVED_FULL.format(mode=mode.name))
