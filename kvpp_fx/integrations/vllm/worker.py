"""KVPP inside vLLM's worker process: budget, cache allocation, per-step forward, attention waits.

Only engines with KVPP on reach this module. For them the plugin replaces
``parallel_config.worker_cls`` (the platform's worker, e.g. ``vllm.v1.worker.cpu_worker.CPUWorker``
or ``vllm.v1.worker.gpu_worker.Worker``) by ``kvpp_fx.integrations.vllm.worker.KVPPWorker__<that
name, dots as __>``. vLLM resolves that name in its worker processes; this module then builds a
subclass of the platform's worker, and after ``init_device`` turns the worker's model runner into a
subclass of its own class (vLLM's V1 ``GPUModelRunner`` or its CPU subclass). Nothing else in the
process changes, except one module attribute: ``gpu_model_runner.allocate_kv_cache`` delegates to
vLLM's function unless a KVPP runner is allocating.

- Budget: ``determine_available_memory`` picks compact or whole-layer scratch slots (`scratch`) and
  returns the *logical* budget ``plan.num_blocks(avail) x the sum of vLLM's page sizes``, so vLLM's
  unchanged planner lands on the block count KVPP can hold.
- Allocation: the runner's ``initialize_kv_cache_tensors`` runs with KVPP's allocator in place of
  vLLM's: owned layers get persistent bundles, the others a scratch slot (S blocks when compact), MTP
  layers a local draft cache. vLLM binds them by layer name. A self-check then proves every cache
  layer is bound to its KVPP view and vLLM's ``num_blocks`` is at most the budget's. With compact
  slots the block zeroer and copy-on-write touch only the persistent views.
- Steps: ``_model_forward`` (the target model's forward inside ``execute_model``) runs under
  ``runtime.forward(has_history, blocks)``: ``has_history = any(num_computed_tokens > 0)`` over the
  input batch, ``blocks`` = `specs.active_blocks` of its block table (when the runtime takes them). Drafting (``sample_tokens``) runs outside it: MTP layers are local and get no kvpp ops.
  Dummy, profile and warm-up runs run with the kvpp ops in passthrough and broadcast nothing.
- Eager attention: each target layer's ``MLAAttention`` (and SFA ``Indexer``) becomes a subclass whose
  forward waits for its layer and prefetches the next one first; under a breakable CUDA-graph capture
  that wait is recorded as an eager segment, rerun on every replay; under Dynamo the graph pass places
  the ops instead (see `compilation`). In mode 3 the worker makes vLLM build KVPP's ``VllmBackend``.

What CPU runs and CUDA would run differently: the worker classes (``CPUWorker`` overrides
``determine_available_memory``, ``CPUModelRunner`` overrides ``load_model``); every hooked runner
method is ``GPUModelRunner``'s own on both.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any

import numpy as np
import torch

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import PoolTooSmallError
from kvpp_fx.config import KVPPConfig, parse_kvpp_mode
from kvpp_fx.config import _model_kind_of
from kvpp_fx.integrations.vllm import owner_rows, packed_metadata, scratch
from kvpp_fx.integrations.vllm.compilation import install_vllm_backend
from kvpp_fx.integrations.vllm.specs import (
    INDEXER_COMPONENT,
    VllmPlan,
    active_blocks,
    per_layer_specs,
    plan_from_specs,
    written_blocks,
)
from kvpp_fx.integrations.vllm.validation import SUPPORTED_VLLM
from kvpp_fx.integrations.vllm.state import (
    WORKER_PREFIX,
    EngineState,
    KVPPAllocationError,
    KVPPHookError,
    current_engine,
    hooked_worker_qualname,
    wrapped_worker_qualname,
)
from kvpp_fx.ops import passing_through, passthrough
from kvpp_fx.runtime.device import resolve_device_api
from kvpp_fx.runtime.errors import NoActiveForwardError
from kvpp_fx.runtime.runtime import KVPPRuntime, active_runtime

logger = logging.getLogger(__name__)

_HOOK_MARK = "_kvpp_fx_hook"

__all__ = ["hooked_worker_qualname", "kvpp_worker_class", "kvpp_runner_class", "worker_stats", "current_engine"]


def vllm_version() -> str:
    try:
        import vllm
        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown"


def hook_error(hook: str, why: str) -> KVPPHookError:
    return KVPPHookError(f"KVPP cannot hook {hook} on vLLM {vllm_version()} (kvpp-fx supports vLLM "
                         f"{SUPPORTED_VLLM}): {why}")


def __getattr__(name: str) -> Any:
    if name.startswith(WORKER_PREFIX):
        from vllm.utils.import_utils import resolve_obj_by_qualname

        return kvpp_worker_class(resolve_obj_by_qualname(wrapped_worker_qualname(name)))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _require(cls: type, methods: tuple[str, ...]) -> None:
    for method in methods:
        if not callable(getattr(cls, method, None)):
            raise hook_error(f"{cls.__module__}.{cls.__qualname__}.{method}", "the method does not exist.")


@functools.cache
def kvpp_worker_class(base: type) -> type:
    """KVPP's subclass of a vLLM worker class."""
    _require(base, ("init_device", "determine_available_memory", "load_model", "compile_or_warm_up_model"))

    class KVPPWorker(base):  # type: ignore[misc, valid-type]
        def init_device(self) -> None:
            super().init_device()
            runner = getattr(self, "model_runner", None)
            if runner is None:
                raise hook_error(f"{base.__qualname__}.init_device", "the worker built no model_runner.")
            runner.__class__ = kvpp_runner_class(type(runner))
            config = KVPPConfig.from_vllm_config(self.vllm_config)
            runner._kvpp = EngineState(config, self.vllm_config, mode=config.mode)
            if int(self.vllm_config.compilation_config.mode or 0) == 3:
                # Before load_model: vLLM builds its backend when it builds the model.
                install_vllm_backend()

        def determine_available_memory(self) -> int:
            state: EngineState = self.model_runner._kvpp
            with state.active():
                available = super().determine_available_memory()
            vplan = _choose_layout(self.model_runner, state, available)
            blocks = vplan.plan.num_blocks(available)
            state.budget_blocks = blocks
            logical = blocks * vplan.logical_bytes_per_block
            logger.warning("KVPP: %d blocks per rank in %d bytes (without KVPP: %d; %s); logical budget %d bytes.",
                           blocks, available, available // vplan.logical_bytes_per_block, state.scratch_choice,
                           logical)
            return logical

        def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
            with self.model_runner._kvpp.active():
                return super().compile_or_warm_up_model(*args, **kwargs)

        # Reachable from a running server too (``POST /collective_rpc`` with VLLM_SERVER_DEV_MODE=1).
        def kvpp_stats(self) -> dict[str, Any] | None:
            return worker_stats(self)

        def kvpp_set_device_api(self, factory: str | None = None) -> None:
            """The tests' one seam into a worker (``collective_rpc("kvpp_set_device_api", args=(...,))``):
            rebuild this worker's runtime over the same cache with the `DeviceAPI` that `factory` (a
            ``"module:callable"`` name, called with the cache's device) returns; None restores the
            default. The tests pass fault-injecting device APIs from their own tree this way."""
            _set_device_api(self.model_runner._kvpp, factory)

        def kvpp_set_mode(self, mode: str) -> None:
            """Set the mode of the following steps ("broadcast", "owner" or "auto"), as
            ``additional_config.kvpp_mode`` sets it at start (``collective_rpc``: every worker at once)."""
            _set_mode(self.model_runner._kvpp, mode)

    KVPPWorker.__name__ = f"KVPP{base.__name__}"
    KVPPWorker.__qualname__ = WORKER_PREFIX + f"{base.__module__}.{base.__qualname__}".replace(".", "__")
    return KVPPWorker


RUNNER_HOOKS = ("load_model", "initialize_kv_cache_tensors", "execute_model", "_model_forward", "_dummy_run",
                "sample_tokens", "get_kv_cache_spec", "_update_states", "_zero_block_ids", "_init_kv_zero_meta")


@functools.cache
def kvpp_runner_class(base: type) -> type:
    """KVPP's subclass of vLLM's V1 model runner class `base` (GPU or CPU)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not issubclass(base, GPUModelRunner):
        raise hook_error(f"{base.__module__}.{base.__qualname__}",
                         "KVPP hooks vLLM's V1 GPUModelRunner and its subclasses; set VLLM_USE_V2_MODEL_RUNNER=0.")
    _require(base, RUNNER_HOOKS)
    _install_allocator()

    class KVPPModelRunner(base):  # type: ignore[misc, valid-type]
        _kvpp: EngineState

        def load_model(self, *args: Any, **kwargs: Any) -> Any:
            result = super().load_model(*args, **kwargs)
            state = self._kvpp
            state.vplan = _plan(self, state, self.get_kv_cache_spec())
            hooked = _hook_attention(self, state)
            state.compact_blocker = scratch.compact_blocker(self.vllm_config, state.owner_blocker) \
                if state.config.size > 1 else "KVPP is off"
            if state.config.scratch_blocks is not None and state.compact_blocker is not None:
                raise scratch.ScratchLayoutError(scratch.refusal(state.compact_blocker))
            plan = state.plan
            logger.warning("KVPP: layers %s broadcast, drafts %s local; eager waits on %d modules; decode rows "
                           "to the owner: %s; compact scratch slots: %s.", list(plan.target_layers),
                           list(plan.local_draft_layers), hooked, state.owner_blocker or "possible",
                           state.compact_blocker or "possible")
            return result

        def initialize_kv_cache_tensors(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
            state = self._kvpp
            if getattr(self, "shared_kv_cache_layers", None):
                # Such layers alias another layer's cache and have no spec of their own: they would read
                # a scratch slot without waiting for it.
                raise KVPPAllocationError(
                    f"KVPP does not support KV-sharing layers ({sorted(self.shared_kv_cache_layers)}).")
            token = _ALLOCATING.set(functools.partial(_allocate, self, state))
            try:
                kv_caches = super().initialize_kv_cache_tensors(kv_cache_config, *args, **kwargs)
            finally:
                _ALLOCATING.reset(token)
            _self_check(self, state, kv_cache_config)
            return kv_caches

        def execute_model(self, *args: Any, **kwargs: Any) -> Any:
            with self._kvpp.active():
                return super().execute_model(*args, **kwargs)

        # vLLM's block zeroer and copy-on-write index every cache view by pool block id. A compact slot
        # holds S positions of copies each step rewrites, never uninitialized memory (it is allocated
        # zeroed): those operations touch the persistent views only.
        def _init_kv_zero_meta(self) -> None:
            if not _compact(self._kvpp):
                super()._init_kv_zero_meta()

        def _zero_block_ids(self, block_ids: list[int]) -> None:
            if not _compact(self._kvpp):
                return super()._zero_block_ids(block_ids)
            for view in _persistent_views(self._kvpp):
                view[torch.as_tensor(block_ids, dtype=torch.long, device=view.device)] = 0

        def _update_states(self, scheduler_output: Any) -> Any:
            if not (_compact(self._kvpp) and getattr(scheduler_output, "kv_cache_block_copies", None)):
                return super()._update_states(scheduler_output)
            every = self.kv_caches
            self.kv_caches = _persistent_views(self._kvpp)
            try:
                return super()._update_states(scheduler_output)
            finally:
                self.kv_caches = every

        def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
            state = self._kvpp
            if state.runtime is None:
                raise KVPPAllocationError("a step ran before KVPP allocated the KV cache.")
            batch = self.input_batch
            num_reqs = batch.num_reqs
            computed = batch.num_computed_tokens_cpu[:num_reqs]
            has_history = bool((computed > 0).any())
            rows = _step_rows(self, state, computed)
            state.note_step(computed, batch.num_prompt_tokens[:num_reqs], mixed=rows is not None and 0 < rows[1] < num_reqs)
            state.awaited.clear()
            if not _packs(state):  # whole layers: the step's metadata cannot be remapped to packed slots
                forward = state.runtime.forward(has_history=has_history)
            elif rows is None:  # no MLA metadata: every row reads its blocks by broadcast
                query = np.diff(self.query_start_loc.np[: num_reqs + 1])
                forward = state.runtime.forward(has_history=has_history,
                                                blocks=active_blocks(batch.block_table, computed, num_reqs),
                                                written=written_blocks(batch.block_table, computed, query, num_reqs))
            else:
                forward = state.runtime.forward(has_history=has_history, mode=state.mode, requests=rows[0])
            with forward:
                if state.runtime.packed:
                    _rebind_packed_metadata(state)
                return super()._model_forward(*args, **kwargs)

        def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
            with self._kvpp.active(), passthrough():
                return super()._dummy_run(*args, **kwargs)

        def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
            with self._kvpp.active():
                return super().sample_tokens(*args, **kwargs)

    KVPPModelRunner.__name__ = KVPPModelRunner.__qualname__ = f"KVPP{base.__name__}"
    return KVPPModelRunner


def _step_rows(runner: Any, state: EngineState, computed: Any) -> Any:
    """The step's requests and decode count from its MLA metadata (`owner_rows.step_requests`)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if state.metadata_layer is None or not is_forward_context_available():
        return None
    batch = runner.input_batch
    return owner_rows.step_requests(get_forward_context().attn_metadata, state.metadata_layer, batch.block_table,
                                    computed, runner.query_start_loc.np, batch.num_reqs,
                                    owner_capable=state.owner_blocker is None)


def _packs(state: EngineState) -> bool:
    """Whether this step's non-owned layers can read packed slots: not with micro-batched (DBO) metadata,
    whose per-micro-batch slot mappings KVPP does not remap, nor for SFA models, whose sparse and indexer
    metadata hold block tables `packed_metadata` does not remap. Those steps send whole layers."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if INDEXER_COMPONENT in {c.name for layer in state.plan.spec.layers for c in layer.components}:
        return False
    return not (is_forward_context_available() and isinstance(get_forward_context().attn_metadata, list))


def _rebind_packed_metadata(state: EngineState) -> None:
    """Non-owned layers read this forward's packed scratch slots through remapped tables."""
    from vllm.forward_context import get_forward_context

    state.packed_layers += packed_metadata.rebind(get_forward_context(), state.runtime, state.vplan.layer_index)


def _set_mode(state: EngineState, mode: str) -> None:
    mode = parse_kvpp_mode(mode)
    if mode == "owner" and state.owner_blocker is not None:
        raise owner_rows.OwnerRowsUnsupportedError(_owner_refusal(state.owner_blocker))
    state.mode = mode
    logger.warning("KVPP: mode %s.", mode)


def _owner_refusal(why: str) -> str:
    return (f"additional_config.kvpp_mode='owner' cannot run here: {why}. Set kvpp_mode to 'auto' (which then "
            "broadcasts) or 'broadcast'.")


def num_target_layers(runner: Any) -> int:
    """The target model's layer count: MTP layers are numbered from it."""
    hf = runner.model_config.hf_text_config
    return int(getattr(hf, "num_hidden_layers"))


def _plan(runner: Any, state: EngineState, specs: dict[str, Any], scratch_blocks: int | None = None) -> VllmPlan:
    # Only compact slots bound the pool below by a max-length request: whole-layer plans take any pool
    # vLLM plans, the small ones of CUDA graph memory profiling included.
    max_model_len = None if scratch_blocks is None else int(runner.model_config.max_model_len)
    return plan_from_specs(specs, state.config.size, num_target_layers(runner), scratch_blocks=scratch_blocks,
                           max_model_len=max_model_len)


def _choose_layout(runner: Any, state: EngineState, available: int) -> VllmPlan:
    """Compact or whole-layer scratch slots for this worker's budget (`scratch.choose_plan`)."""
    specs = runner.get_kv_cache_spec()
    whole = _plan(runner, state, specs)
    if state.compact_blocker is not None:
        state.vplan, state.scratch_blocks = whole, None
        state.scratch_choice = f"whole-layer slots: {state.compact_blocker}"
        return whole
    slots = scratch.slot_blocks(runner.vllm_config, state.config, whole.plan.spec.block_size)
    # Each rank measures its own budget (vLLM CPU's default is what the process has left); the group
    # chooses from the smallest, so every rank chooses alike.
    chosen, state.scratch_choice = scratch.choose_plan(_plan(runner, state, specs, slots), whole,
                                                       _group_minimum(available),
                                                       explicit=state.config.scratch_blocks is not None)
    state.vplan, state.scratch_blocks = chosen, chosen.plan.scratch_blocks
    return chosen


def _group_minimum(available: int) -> int:
    """The smallest of `available` over vLLM's TP group, which is the KVPP group wherever compact slots
    can run (PCP 1; `scratch.compact_blocker`)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return available
    value = torch.tensor([available], dtype=torch.int64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    return int(value.item())


def _compact(state: EngineState) -> bool:
    return state.plan is not None and state.plan.compact


def _persistent_views(state: EngineState) -> list[torch.Tensor]:
    """This rank's vLLM cache views that index the pool: its owned layers' and the drafts'."""
    storage, vplan = state.runtime.storage, state.vplan
    return [storage.typed_views(index)[vplan.component[name]] for name, index in vplan.layer_index.items()
            if state.plan.is_local(index, state.runtime.rank)]


# --- allocation ---------------------------------------------------------------------------------------

_ALLOCATING: contextvars.ContextVar[Any] = contextvars.ContextVar("kvpp_vllm_allocating", default=None)


def _install_allocator() -> None:
    from vllm.v1.worker import gpu_model_runner as module

    original = getattr(module, "allocate_kv_cache", None)
    if not callable(original):
        raise hook_error("vllm.v1.worker.gpu_model_runner.allocate_kv_cache", "the function does not exist.")
    if getattr(original, _HOOK_MARK, False):
        return

    @functools.wraps(original)
    def allocate_kv_cache(kv_cache_config: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        allocate = _ALLOCATING.get()
        if allocate is None:
            return original(kv_cache_config, device, *args, **kwargs)
        return allocate(kv_cache_config, device)

    setattr(allocate_kv_cache, _HOOK_MARK, True)
    module.allocate_kv_cache = allocate_kv_cache


def _allocate(runner: Any, state: EngineState, kv_cache_config: Any, device: Any) -> dict[str, torch.Tensor]:
    vplan = _plan(runner, state, per_layer_specs(kv_cache_config), state.scratch_blocks)
    if state.vplan is not None and vplan.plan.spec != state.vplan.plan.spec:
        raise KVPPAllocationError(f"vLLM's KV cache config {vplan.plan.spec} differs from the model's cache "
                                  f"specs {state.vplan.plan.spec}.")
    state.vplan = vplan
    if state.group is None:
        state.group, state.agreement_group, state.group_ranks = _kvpp_group(state.config)
    _check_layout(state, kv_cache_config.num_blocks)
    rank = torch.distributed.get_rank(state.group)
    storage = allocate_cache(vplan.plan, rank, kv_cache_config.num_blocks, device)
    _create_runtime(state, storage)
    plan = vplan.plan
    logger.warning("KVPP: group %s, rank %d owns layers %s of %d; %d blocks; %d bytes allocated.",
                   state.group_ranks, rank, list(plan.owned_layers(rank)), len(plan.target_layers),
                   kv_cache_config.num_blocks, storage.allocated_bytes)
    # vLLM's per-layer cache view is [blocks, heads=1, tokens, record]; MLA layers squeeze the head.
    return {name: storage.typed_views(index)[vplan.component[name]].unsqueeze(1)
            for name, index in vplan.layer_index.items()}


def _check_layout(state: EngineState, num_blocks: int) -> None:
    """Every rank of the group chose the same slots (each chose from its own budget), and vLLM's block
    count, the smallest any worker's budget holds, still fits compact ones."""
    layouts: list[Any] = [None] * len(state.group_ranks)
    torch.distributed.all_gather_object(layouts, state.scratch_blocks, group=state.agreement_group)
    if len(set(layouts)) != 1:
        raise KVPPAllocationError(
            f"the ranks of KVPP group {state.group_ranks} chose different scratch slots ({layouts}: blocks per slot, "
            "None for whole layers) from different KV cache budgets; give every rank the same KV cache memory, or "
            "set additional_config.kvpp_scratch_blocks.")
    if state.plan.compact:
        try:
            state.plan.check_pool(num_blocks)
        except PoolTooSmallError as exc:
            raise KVPPAllocationError(f"vLLM planned {num_blocks} blocks: {exc}") from None


def _create_runtime(state: EngineState, storage: Any) -> None:
    if state.runtime is not None:
        state.runtime.close()
    state.mixed_steps = state.skipped_cache_writes = state.packed_layers = 0  # counted per runtime, as its stats are
    device_api = None
    if state.device_api_factory is not None:
        device_api = resolve_device_api(state.device_api_factory, storage.device)
    link = owner_rows.DEFAULT_LINKS.get(storage.device.type, owner_rows.DEFAULT_LINKS["cuda"])
    state.runtime = KVPPRuntime.create(state.plan, storage, state.group, agreement_group=state.agreement_group,
                                       device_api=device_api,
                                       attention=owner_rows.attention_shape(state.vllm_config.model_config),
                                       link=link)
    # The MLA hooks exchange the decode rows of every target layer, whichever graph runs it.
    state.runtime.note_routing(state.plan.target_layers, state.owner_blocker is None)


def _set_device_api(state: EngineState, factory: str | None) -> None:
    if state.runtime is None:
        raise KVPPAllocationError("kvpp_set_device_api before KVPP allocated the KV cache.")
    state.device_api_factory = factory
    _create_runtime(state, state.runtime.storage)
    logger.warning("KVPP: runtime rebuilt with device API %s.", factory or "default")


def _self_check(runner: Any, state: EngineState, kv_cache_config: Any) -> None:
    """Every cache layer is bound to its KVPP view, and vLLM plans at most the budget's blocks."""
    if state.runtime is None:
        raise KVPPAllocationError("vLLM allocated its KV cache without KVPP's allocator "
                                  "(gpu_model_runner.allocate_kv_cache was not called).")
    storage = state.runtime.storage
    # vLLM gives every worker the smallest count any worker's budget holds (pipeline stages differ), so
    # fewer blocks than this worker's budget is fine; more would not fit.
    if state.budget_blocks is not None and kv_cache_config.num_blocks > state.budget_blocks:
        raise KVPPAllocationError(
            f"vLLM planned {kv_cache_config.num_blocks} blocks, the KVPP budget holds {state.budget_blocks} "
            "(num_gpu_blocks_override and other block-count overrides above the budget cannot be combined "
            "with KVPP).")
    context = runner.compilation_config.static_forward_context
    vplan = state.vplan
    for name in runner.get_kv_cache_spec():
        if name not in vplan.layer_index:
            raise KVPPAllocationError(f"cache layer {name!r} is not in the KVPP plan.")
    for name, index in vplan.layer_index.items():
        view = storage.typed_views(index)[vplan.component[name]]
        bound = getattr(context.get(name), "kv_cache", None)
        if isinstance(bound, (list, tuple)):
            bound = bound[0] if bound else None
        if not isinstance(bound, torch.Tensor) or bound.data_ptr() != view.data_ptr() or bound.numel() != view.numel():
            raise KVPPAllocationError(f"cache layer {name!r} is not bound to its KVPP view of layer {index}.")


def _kvpp_group(config: KVPPConfig):
    """This rank's KVPP group: TP x PCP ranks from `kvpp_groups`, as a process group of its own (the
    world's backend), and a gloo group of the same ranks for the runtime's per-forward agreement, which
    then needs no device synchronisation."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    from kvpp_fx.topology import create_kvpp_process_groups, group_of, kvpp_groups

    world = dist.get_world_size()
    groups = kvpp_groups(world, tp=config.tp, pcp=config.pcp, pp=world // config.size)
    mine = group_of(dist.get_rank(), groups)
    if not set(get_tp_group().ranks) <= set(mine):
        raise ValueError(f"vLLM's TP group {list(get_tp_group().ranks)} is not inside the KVPP group {mine}.")
    return create_kvpp_process_groups(groups), create_kvpp_process_groups(groups, backend="gloo"), mine


# --- eager attention ----------------------------------------------------------------------------------


def await_layer(state: EngineState, layer: int) -> None:
    """At a target layer's attention entry, once per step (the SFA indexer and the MLA attention of one
    layer share it): what the graph pass inserts, the plan's schedule for the layer
    (`KVPPRuntime.enter_layer`, as a graph whose layer is a run-time value runs it), routed when the MLA
    hooks exchange owner rows. Nothing in passthrough (dummy, profile and capture runs)."""
    runtime = active_runtime()
    if runtime is None or runtime is not state.runtime:
        if not passing_through():  # a model call outside a step and outside a dummy run
            raise NoActiveForwardError(
                f"layer {layer}'s attention ran outside its engine's KVPP forward; its cache view would "
                "not hold the layer's bytes.")
    elif layer not in state.awaited:
        state.awaited.add(layer)
        runtime.enter_layer(layer, routed=state.owner_blocker is None)


def breakable_capture() -> Any:
    """vLLM's breakable CUDA-graph capture recording on this thread, or None.

    Under ``VLLM_USE_BREAKABLE_CUDAGRAPH`` (on by default for DeepSeek-V3.2 and GLM-5 class models) the
    model's Python runs once, at capture, and each replay reruns only the recorded segments: a wait
    done in plain Python would be skipped on every replayed step. Recorded as an eager segment, it
    reruns on each replay, in capture order, reading the step's runtime when it runs.
    """
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    capture = BreakableCUDAGraphCapture.current()
    return capture if capture is not None and capture._capturing else None


@functools.cache
def _waiting_class(cls: type, writes: bool = False) -> type:
    """`cls` whose forward waits for its layer first; with ``writes`` (an MLA attention layer), whose cache
    write is skipped on a non-owner when every row of the step goes to the owner."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Traced by Dynamo in the compiled path, where the graph pass places the ops instead.
        if not torch.compiler.is_compiling():
            capture = breakable_capture()
            if capture is not None:
                capture.add_eager(functools.partial(await_layer, self._kvpp_engine, self._kvpp_layer))
            else:
                await_layer(self._kvpp_engine, self._kvpp_layer)
        return cls.forward(self, *args, **kwargs)

    def update_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
        if owner_rows.skips_cache_write(self):
            self._kvpp_engine.skipped_cache_writes += 1
            return None
        return cls.update_kv_cache(self, *args, **kwargs)

    methods = {"forward": forward, "__module__": __name__}
    if writes:
        methods["update_kv_cache"] = update_kv_cache
    return type(f"KVPP{cls.__name__}", (cls,), methods)


def _hook_attention(runner: Any, state: EngineState) -> int:
    """Make the modules that read a target layer's cache wait for it: the MLA attention layer and,
    for SFA, the indexer that owns ``<...>.indexer.k_cache`` (it runs first)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    context = runner.compilation_config.static_forward_context
    modules = dict(runner.get_model().named_modules())
    vplan, targets = state.vplan, set(state.plan.target_layers)
    attention = {name: context.get(name) for name, index in vplan.layer_index.items()
                 if index in targets and vplan.component[name] != INDEXER_COMPONENT}
    backends = {layer.get_attn_backend().get_name() for layer in attention.values() if isinstance(layer, MLAAttention)}
    config = state.config
    state.owner_blocker = owner_rows.why_not_owner_capable(
        backends, _model_kind_of(runner.model_config), config.pcp) if config.size > 1 else "KVPP is off"
    if state.mode == "owner" and state.owner_blocker is not None:
        raise owner_rows.OwnerRowsUnsupportedError(_owner_refusal(state.owner_blocker))
    hooked = 0
    for name, index in vplan.layer_index.items():
        if index not in targets:
            continue
        if vplan.component[name] == INDEXER_COMPONENT:
            reader = modules.get(name.rsplit(".", 1)[0])
        else:
            reader = context.get(name)
            if not isinstance(reader, MLAAttention):
                raise hook_error(f"attention layer {name!r}", f"expected an MLAAttention, got {type(reader).__name__}.")
            state.metadata_layer = state.metadata_layer or name
            if state.owner_blocker is None:
                owner_rows.hook_impl(reader, state, index)
        if reader is None:
            raise hook_error(f"cache reader of {name!r}", "no module of the model reads this cache.")
        reader._kvpp_engine, reader._kvpp_layer = state, index
        reader.__class__ = _waiting_class(type(reader), isinstance(reader, MLAAttention))
        hooked += 1
    return hooked


# --- inspection -----------------------------------------------------------------------------------------


def worker_stats(worker: Any = None) -> dict[str, Any] | None:
    """For ``llm.collective_rpc(worker_stats)``: this worker's KVPP counters and allocation."""
    state = getattr(getattr(worker, "model_runner", None), "_kvpp", None)
    if state is None or state.runtime is None:
        return None
    runtime = state.runtime
    stats = runtime.stats()
    stats["num_blocks"] = runtime.storage.num_blocks
    stats["owned_layers"] = list(runtime.plan.owned_layers(runtime.rank))
    stats["draft_layers"] = list(runtime.plan.local_draft_layers)
    stats["compiled_graphs"] = [{"kind": kind, "layers": list(layers)} for kind, layers in state.compiled_graphs]
    stats["worker_class"] = type(worker.worker if hasattr(worker, "worker") else worker).__name__
    stats["runner_class"] = type(worker.model_runner).__name__
    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    stats["attention_backends"] = sorted({layer.get_attn_backend().get_name() for name, layer in context.items()
                                          if name in state.vplan.layer_index and hasattr(layer, "get_attn_backend")})
    stats["block_size"] = state.plan.spec.block_size
    stats["steps"] = state.steps
    stats["mixed_steps"] = state.mixed_steps
    stats["skipped_cache_writes"] = state.skipped_cache_writes
    stats["packed_layers"] = state.packed_layers
    stats["scratch_blocks"] = state.scratch_blocks
    stats["slot_blocks"] = runtime.storage.slot_blocks
    stats["compact_blocker"] = state.compact_blocker
    stats["kvpp_mode"] = state.mode
    stats["owner_blocker"] = state.owner_blocker
    stats["prefill_rows_with_history"] = state.prefill_rows_with_history
    stats["device_api"] = state.device_api_factory
    return stats
