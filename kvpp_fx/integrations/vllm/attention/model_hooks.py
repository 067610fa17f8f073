"""What KVPP changes in the loaded model: eager waits on target layers' attention, owner rows in their
MLA impls, and the plan and layout choices that follow from the model's backends.

Invariants:
- Every module that reads a target layer's cache (the ``MLAAttention`` layer and, for SFA, the
  indexer, which runs first) waits for its layer once per step before reading (`await_layer`), in
  eager mode; under Dynamo the graph pass places the ops instead, and under a breakable CUDA-graph
  capture the wait is recorded as an eager segment that reruns on every replay.
- Outside a step's forward a target layer's attention raises `NoActiveForwardError`, except in
  passthrough (dummy, profile, warm-up and capture runs).
- A non-owned layer's cache write reads the step's slot mapping (KVPP's remapped one in a packed step)
  and is skipped on a non-owner in owner mode. Under a breakable CUDA-graph capture vLLM records only
  MLA attention as an eager segment; the write would be captured with the capture's slot mapping and
  replayed on every step, so KVPP records it as an eager segment that reads the step's forward context
  when it runs (`replayed_cache_write`).
- Decode rows go to the owner only where `owner_rows.why_not_owner_capable` says the backend can run
  them; ``kvpp_mode="owner"`` elsewhere is refused with the reason.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from kvpp_fx.cache.cost import Mode
from kvpp_fx.integrations.vllm.setup.config import model_kind_of, parse_kvpp_mode
from kvpp_fx.integrations.vllm.attention import context_stream, owner_rows
from kvpp_fx.integrations.vllm.cache import scratch
from kvpp_fx.integrations.vllm.cache.layout import plan_loaded_model
from kvpp_fx.integrations.vllm.cache.specs import INDEXER_COMPONENT
from kvpp_fx.integrations.vllm.engine.state import EngineState, hook_error, open_runtime
from kvpp_fx.runtime.errors import NoActiveForwardError
from kvpp_fx.runtime.graph_ops import passing_through

logger = logging.getLogger(__name__)


def prepare_model(runner: Any, state: EngineState) -> None:
    """After vLLM loaded the model: the plan from its cache specs, the attention hooks, and whether
    compact slots can run (an explicit ``kvpp_scratch_blocks`` that cannot is refused here)."""
    plan_loaded_model(runner, state)
    hooked = hook_attention(runner, state)
    choices = state.attention
    choices.compact_blocker = (scratch.compact_blocker(state.vllm_config, choices.owner_blocker,
                                                       choices.streams_history, choices.mode,
                                                       choices.owner_only_hazard)
                               if state.config.size > 1 else "KVPP is off")
    if state.config.scratch_blocks is not None and choices.compact_blocker is not None:
        raise scratch.ScratchLayoutError(scratch.refusal(choices.compact_blocker))
    plan = state.plan
    logger.warning("KVPP (model runner %s): layers %s broadcast, drafts %s local; eager waits on %d modules; decode "
                   "rows to the owner: %s; compact scratch slots: %s.", state.runner_kind, list(plan.target_layers),
                   list(plan.local_draft_layers), hooked, choices.owner_blocker or "possible",
                   choices.compact_blocker or "possible")


def await_layer(state: EngineState, layer: int) -> None:
    """At a target layer's attention entry, once per step (the SFA indexer and the MLA attention of one
    layer share it): what the graph pass inserts, the plan's schedule for the layer
    (`KVPPRuntime.enter_layer`, as a graph whose layer is a run-time value runs it), routed when the MLA
    hooks exchange owner rows. Nothing in passthrough (dummy, profile and capture runs)."""
    runtime = open_runtime(state)
    if runtime is None:
        if not passing_through():  # a model call outside a step and outside a dummy run
            raise NoActiveForwardError(
                f"layer {layer}'s attention ran outside its engine's KVPP forward; its cache view would "
                "not hold the layer's bytes.")
    elif state.step.first_wait(layer):
        runtime.enter_layer(layer, routed=state.attention.owner_blocker is None)


def breakable_capture() -> Any:
    """vLLM's breakable CUDA-graph capture recording on this thread, or None.

    Under ``VLLM_USE_BREAKABLE_CUDAGRAPH`` (on by default for DeepSeek-V3.2 and GLM-5 class models) the
    model's Python runs once, at capture, and each replay reruns only the recorded segments: a wait
    done in plain Python would be skipped on every replayed step. Recorded as an eager segment, it
    reruns on each replay, in capture order, reading the step's runtime when it runs.
    """
    capture = _capture_class().current()
    return capture if capture is not None and capture._capturing else None


@functools.cache
def _capture_class() -> type:
    # Looked up once: `breakable_capture` runs at every target layer's attention and cache write, each step.
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    return BreakableCUDAGraphCapture


@functools.cache
def waiting_class(cls: type, writes: bool = False, indexer: bool = False) -> type:
    """`cls` whose forward waits for its layer first; with ``writes`` (an MLA attention layer), whose cache
    write is skipped on a non-owner when every row of the step goes to the owner; with ``indexer`` (an SFA
    layer's indexer module, vLLM's generic ``Indexer``), which that non-owner skips whole in eager forwards: its
    keys are written, and its top-k read, on the owner. (In a compiled piece or a breakable capture the indexer
    runs on the non-owner too, into its scratch slot; nothing reads what it computes there.)"""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Traced by Dynamo in the compiled path, where the graph pass places the ops instead.
        if not torch.compiler.is_compiling():
            capture = breakable_capture()
            if capture is not None:
                capture.add_eager(functools.partial(await_layer, self._kvpp_engine, self._kvpp_layer))
            else:
                await_layer(self._kvpp_engine, self._kvpp_layer)
                if indexer and owner_rows.skips_cache_write(self):
                    self._kvpp_engine.counters.note_skipped_indexer()
                    return self.topk_indices_buffer
        return cls.forward(self, *args, **kwargs)

    def update_kv_cache(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: Any, attn_metadata: Any, kv_cache_dtype: str, k_scale: Any) -> Any:
        capture = breakable_capture()
        if capture is not None:
            return capture.add_eager(functools.partial(
                replayed_cache_write, self, replay_ref(kv_c_normed), replay_ref(k_pe), kv_cache_dtype, k_scale))
        if owner_rows.skips_cache_write(self):
            self._kvpp_engine.counters.note_skipped_cache_write()
            return None
        return cls.update_kv_cache(self, kv_c_normed, k_pe, kv_cache, slot_mapping, attn_metadata, kv_cache_dtype,
                                   k_scale)

    methods = {"forward": forward, "__module__": __name__}
    if writes:
        methods["update_kv_cache"] = update_kv_cache
    return type(f"KVPP{cls.__name__}", (cls,), methods)


def replayed_cache_write(layer: Any, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache_dtype: str,
                         k_scale: Any) -> None:
    """An MLA layer's cache write as an eager segment of a breakable capture: at capture and on each
    replay, with the inputs' static buffers and the cache, metadata and slot mapping of the step running
    now (as vLLM's own unified MLA cache-write op reads them)."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    metadata, _, kv_cache, slot_mapping = get_attention_context(layer.layer_name)
    layer.update_kv_cache(kv_c_normed, k_pe, kv_cache, slot_mapping, metadata, kv_cache_dtype, k_scale)


def replay_ref(tensor: torch.Tensor) -> torch.Tensor:
    """What an eager segment keeps of a captured input: a weak reference, as vLLM's own eager breaks keep
    (a strong one would pin a CUDA-graph pool slot across batch sizes), where vLLM's build has the op;
    the tensor itself elsewhere (CPU builds, which capture nothing)."""
    if tensor.is_cuda and hasattr(torch.ops._C, "weak_ref_tensor"):
        from vllm.utils.torch_utils import weak_ref_tensor

        return weak_ref_tensor(tensor)
    return tensor


def own_cache_writers(classes: set[type]) -> tuple[str, ...]:
    """The MLA layer classes with a forward of their own, which may write their cache inside a fused kernel
    with vLLM's slot mapping (vLLM's DeepSeek-V3.2 and GLM-5 attention on CUDA does, in ``fused_norm_rope``),
    where KVPP can neither remap nor skip the write."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return tuple(sorted(cls.__qualname__ for cls in classes if cls.forward is not MLAAttention.forward))


def captures_graphs(runner: Any) -> bool:
    """Whether vLLM captures CUDA graphs of this runner's model (vLLM CPU clears its capture sizes)."""
    compilation = runner.vllm_config.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    return bool(getattr(compilation, "cudagraph_capture_sizes", None)) and getattr(mode, "name", "NONE") != "NONE"


def owner_only_hazard(backends: set[str], classes: set[type], breakable: bool) -> str | None:
    """Why an SFA model's steps could not run on owner-only slots (`scratch.owner_only`), which hold no layer: a
    backend not declared to route every token as a decode row (a prefill step could not go to the owners), or
    a cache write a non-owner would make that KVPP cannot skip (an attention's own forward; an indexer replayed
    by a breakable CUDA-graph capture with vLLM's slot mapping). None where they can."""
    from kvpp_fx.integrations.vllm.attention.backends import BACKENDS

    splitting = sorted(name for name in backends if not BACKENDS[name].routes_every_token)
    if splitting:
        return (f"attention backends {splitting} are not declared to route every token as a decode row "
                "(OwnerSupport.routes_every_token), so a prefill step's rows may not all go to the owners")
    own = own_cache_writers(classes)
    if own:
        return (f"{list(own)} write their MLA cache in their own forward with vLLM's slot mapping, which KVPP "
                "cannot skip on a rank that does not hold the layer")
    if breakable:
        return ("under breakable CUDA graphs a non-owner's indexer runs inside the capture and writes its keys with "
                "vLLM's slot mapping")
    return None


def own_cache_writes_under_capture(classes: set[type], breakable: bool) -> str | None:
    """Why decode rows cannot go to their owners (and so slots stay whole layers) under breakable CUDA
    graphs, or None. KVPP's eager cache write (`replayed_cache_write`) serves vLLM's ``MLAAttention.forward``,
    which writes through the unified MLA cache-write op. A subclass with a forward of its own may write its
    cache inside a fused kernel of a captured segment (vLLM's DeepSeek-V3.2 and GLM-5 attention does, in
    ``fused_norm_rope``), which replays the capture's slot mapping: right for whole-layer slots, which hold
    every block at its pool id, wrong for a remapped mapping or an owner-mode write skip."""
    own = own_cache_writers(classes)
    if not breakable or not own:
        return None
    return (f"under breakable CUDA graphs, {own} write their MLA cache in their own forward, which a captured "
            "segment replays with vLLM's slot mapping")


def hook_attention(runner: Any, state: EngineState) -> int:
    """Make the modules that read a target layer's cache wait for it: the MLA attention layer and,
    for SFA, the indexer that owns ``<...>.indexer.k_cache`` (it runs first)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    context = runner.compilation_config.static_forward_context
    modules = dict(runner.get_model().named_modules())
    vplan, targets = state.vplan, set(state.plan.target_layers)
    attention = {name: context.get(name) for name, index in vplan.layer_index.items()
                 if index in targets and vplan.component[name] != INDEXER_COMPONENT}
    mla = [layer for layer in attention.values() if isinstance(layer, MLAAttention)]
    backends = {layer.get_attn_backend().get_name() for layer in mla}
    config, choices = state.config, state.attention
    choices.owner_blocker = owner_rows.why_not_owner_capable(
        backends, model_kind_of(runner.model_config), config.pcp) if config.size > 1 else "KVPP is off"
    if choices.owner_blocker is None:
        layers = {index for name, index in vplan.layer_index.items() if index in targets}
        indexed = {index for name, index in vplan.layer_index.items()
                   if index in targets and vplan.component[name] == INDEXER_COMPONENT}
        if indexed:
            choices.owner_blocker = owner_rows.shared_topk_blocker(layers, indexed)
    if choices.owner_blocker is None:
        from kvpp_fx.integrations.vllm.plugin import breakable_cudagraphs

        classes, breakable = {type(layer) for layer in mla}, breakable_cudagraphs()
        choices.owner_blocker = own_cache_writes_under_capture(classes, breakable)
        choices.owner_only_hazard = owner_only_hazard(backends, classes, breakable and captures_graphs(runner))
    if choices.mode == Mode.OWNER and choices.owner_blocker is not None:
        raise owner_rows.OwnerRowsUnsupportedError(owner_refusal(choices.owner_blocker))
    hooked, streaming = 0, []
    if choices.owner_blocker is None:
        context_stream.wrap_gathers()
    for name, index in vplan.layer_index.items():
        if index not in targets:
            continue
        if vplan.component[name] == INDEXER_COMPONENT:
            reader = modules.get(name.rsplit(".", 1)[0])
        else:
            reader = context.get(name)
            if not isinstance(reader, MLAAttention):
                raise hook_error(f"attention layer {name!r}", f"expected an MLAAttention, got {type(reader).__name__}.")
            choices.metadata_layer = choices.metadata_layer or name
            if choices.owner_blocker is None:
                owner_rows.hook_impl(reader, state, index)
                streaming.append(context_stream.hook_impl(reader))
        if reader is None:
            raise hook_error(f"cache reader of {name!r}", "no module of the model reads this cache.")
        reader._kvpp_engine, reader._kvpp_layer = state, index
        is_mla = isinstance(reader, MLAAttention)
        reader.__class__ = waiting_class(type(reader), writes=is_mla,
                                         indexer=not is_mla and choices.owner_blocker is None)
        hooked += 1
    choices.streams_history = bool(streaming) and all(streaming)
    return hooked


def set_mode(state: EngineState, mode: str) -> None:
    """The mode of the following steps ("broadcast", "owner" or "auto")."""
    mode = parse_kvpp_mode(mode)
    if mode == Mode.OWNER and state.attention.owner_blocker is not None:
        raise owner_rows.OwnerRowsUnsupportedError(owner_refusal(state.attention.owner_blocker))
    state.attention.mode = mode
    logger.warning("KVPP: mode %s.", mode)


def owner_refusal(why: str) -> str:
    return (f"additional_config.kvpp_mode='owner' cannot run here: {why}. Set kvpp_mode to 'auto' (which then "
            "broadcasts) or 'broadcast'.")
