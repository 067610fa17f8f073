"""KVPP's cache allocation inside vLLM, the runtime over it, and the post-allocation self-check.

Invariants:
- vLLM's ``allocate_kv_cache`` is wrapped where each model runner calls it (`install_allocator`: V1's
  ``gpu_model_runner``, V2's ``gpu.attn_utils``); it delegates to vLLM's function unless a KVPP runner
  is allocating (`allocating`), so any other engine in the process allocates as before.
- Owned layers get persistent bundles, the others a scratch slot (S blocks when compact), MTP layers
  a local draft cache; vLLM binds them by layer name. Every rank of a group allocates the same layout
  (`check_layout`), and `self_check` then proves every cache layer is bound to its KVPP view and
  vLLM's block count is at most the budget's.
- Under a quantized (fp8) cache every rank of a group holds the same q and k scales for each layer
  (`check_scales`): a rank reads the owner's cache bytes, and the owner descales every rank's quantized
  queries, with the owner's scales.
- Block ids mean one thing everywhere: vLLM's KV cache manager blocks. A backend that splits them into
  smaller kernel blocks (vLLM's virtual block splitting: its metadata tables then hold kernel block ids)
  is refused before anything is allocated (`check_kernel_blocks`), naming the block size to set.
- Operations that index caches by pool block id outside attention (the block zeroer, copy-on-write)
  touch the persistent views only when the slots are compact (`persistent_views`).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import PoolTooSmallError
from kvpp_fx.integrations.vllm.attention import owner_rows
from kvpp_fx.integrations.vllm.cache.layout import plan_allocation
from kvpp_fx.integrations.vllm.engine.state import EngineState, KVPPAllocationError, wrap_module_function
from kvpp_fx.runtime.device import resolve_device_api
from kvpp_fx.runtime.runtime import KVPPRuntime

logger = logging.getLogger(__name__)

_ALLOCATING: contextvars.ContextVar[Any] = contextvars.ContextVar("kvpp_vllm_allocating", default=None)


def install_allocator(module_name: str) -> None:
    """Wrap ``allocate_kv_cache`` in the vLLM module `module_name` (idempotent)."""
    wrap_module_function(module_name, "allocate_kv_cache", kvpp_allocator)


def kvpp_allocator(original: Callable) -> Callable:
    """vLLM's ``allocate_kv_cache`` `original`, allocating KVPP's layout while a KVPP runner is `allocating`."""
    signature = inspect.signature(original)

    def allocate_kv_cache(kv_cache_config: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        allocate = _ALLOCATING.get()
        if allocate is None:
            return original(kv_cache_config, device, *args, **kwargs)
        given = signature.bind(kv_cache_config, device, *args, **kwargs).arguments
        check_kernel_blocks(kv_cache_config, given.get("kernel_block_sizes"))
        return allocate(kv_cache_config, device, lambda config: original(config, device, *args, **kwargs))

    return allocate_kv_cache


@contextlib.contextmanager
def allocating(runner: Any, state: EngineState) -> Iterator[None]:
    """While open, vLLM's ``allocate_kv_cache`` allocates KVPP's layout for `runner`."""
    with allocating_with(lambda config, device, _: allocate(runner, state, config, device)):
        yield


@contextlib.contextmanager
def allocating_with(allocate_cache: Callable[[Any, Any, Callable[[Any], Any]], Any]) -> Iterator[None]:
    """While open, vLLM's ``allocate_kv_cache(config, device, ...)`` returns ``allocate_cache(config, device,
    vllm_allocate)``, where ``vllm_allocate(config)`` is vLLM's own with the call's other arguments."""
    token = _ALLOCATING.set(allocate_cache)
    try:
        yield
    finally:
        _ALLOCATING.reset(token)


class KernelBlockSizeError(KVPPAllocationError):
    """The attention backend reads kernel blocks smaller than vLLM's KV cache blocks."""


def check_kernel_blocks(kv_cache_config: Any, kernel_block_sizes: Any) -> None:
    """Refuse a KV cache group whose attention kernels read blocks of another size than its own: their
    metadata tables would hold kernel block ids, while KVPP's packed slots, positions and remapped
    tables count manager blocks."""
    for group, kernel in zip(kv_cache_config.kv_cache_groups, kernel_block_sizes or ()):
        block = group.kv_cache_spec.block_size
        if kernel != block:
            raise KernelBlockSizeError(
                f"KVPP needs the attention kernels to read the KV cache's own blocks; the backend of layers "
                f"{list(group.layer_names)[:2]}... reads {kernel}-token kernel blocks of the {block}-token "
                f"blocks (vLLM's virtual block splitting). Set block_size={kernel} (cache_config.block_size, "
                "--block-size), or leave block_size to vLLM's default for the backend.")


def refuse_kv_sharing(shared_layers: Any) -> None:
    if shared_layers:
        # Such layers alias another layer's cache and have no spec of their own: they would read a
        # scratch slot without waiting for it.
        raise KVPPAllocationError(f"KVPP does not support KV-sharing layers ({sorted(shared_layers)}).")


def allocate(runner: Any, state: EngineState, kv_cache_config: Any, device: Any) -> dict[str, torch.Tensor]:
    vplan = plan_allocation(runner, state, kv_cache_config)
    connect(state, device)
    check_layout(state, kv_cache_config.num_blocks)
    check_scales(quantized_cache_scales(runner, vplan.layer_index), state.comm.agreement_group,
                 state.comm.group_ranks)
    comm = state.comm
    rank = torch.distributed.get_rank(comm.group)
    if comm.runtime is not None:
        # An earlier allocation (V2's minimal cache for CUDA-graph memory profiling, which vLLM drops
        # before allocating the real one): its pool goes first, or both would be alive at once.
        comm.runtime.close()
        comm.runtime = None
    storage = allocate_cache(vplan.plan, rank, kv_cache_config.num_blocks, device)
    create_runtime(state, storage, comm.device_api_factory)
    plan = vplan.plan
    logger.warning("KVPP: group %s, rank %d owns layers %s of %d; %d blocks; %d bytes allocated.",
                   comm.group_ranks, rank, list(plan.owned_layers(rank)), len(plan.target_layers),
                   kv_cache_config.num_blocks, storage.allocated_bytes)
    # vLLM's per-layer cache view is [blocks, heads=1, tokens, record]; MLA layers squeeze the head.
    return {name: storage.typed_views(index)[vplan.component[name]].unsqueeze(1)
            for name, index in vplan.layer_index.items()}


def check_layout(state: EngineState, num_blocks: int) -> None:
    """Every rank of the group chose the same slots (each chose from its own budget), and vLLM's block
    count, the smallest any worker's budget holds, still fits compact ones."""
    comm = state.comm
    layouts: list[Any] = [None] * len(comm.group_ranks)
    torch.distributed.all_gather_object(layouts, state.layout.scratch_blocks, group=comm.agreement_group)
    if len(set(layouts)) != 1:
        raise KVPPAllocationError(
            f"the ranks of KVPP group {comm.group_ranks} chose different scratch slots ({layouts}: blocks per slot, "
            "None for whole layers) from different KV cache budgets; give every rank the same KV cache memory, or "
            "set additional_config.kvpp_scratch_blocks.")
    if state.plan.compact:
        try:
            state.plan.check_pool(num_blocks)
        except PoolTooSmallError as exc:
            raise KVPPAllocationError(f"vLLM planned {num_blocks} blocks: {exc}") from None


def quantized_cache_scales(runner: Any, layer_index: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Each target attention layer's (q scale, k scale) where its cache is quantized: the values its kernels
    quantize and descale with (static in vLLM 0.32: 1.0, or the checkpoint's). Read once, after loading."""
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    context = runner.compilation_config.static_forward_context
    scales = {}
    for name in layer_index:
        layer = context.get(name)
        cache_dtype = getattr(layer, "kv_cache_dtype", "auto")
        if hasattr(layer, "_q_scale") and is_quantized_kv_cache(cache_dtype):
            scales[name] = (float(layer._q_scale), float(layer._k_scale))
    return scales


def check_scales(scales: dict[str, tuple[float, float]], agreement_group: Any, group_ranks: Any) -> None:
    """Every rank of the group holds the same quantization scales for each layer (`quantized_cache_scales`)."""
    gathered: list[Any] = [None] * torch.distributed.get_world_size(agreement_group)
    torch.distributed.all_gather_object(gathered, scales, group=agreement_group)
    for name in sorted(set().union(*gathered)):
        values = [rank_scales.get(name) for rank_scales in gathered]
        if len(set(values)) != 1:
            raise KVPPAllocationError(
                f"the ranks of KVPP group {group_ranks} hold different quantization scales for {name!r} "
                f"((q scale, k scale) by rank: {values}); KVPP reads a layer's fp8 cache, and descales every "
                "rank's quantized queries, with its owner's scales. Give every rank the same scales.")


def create_runtime(state: EngineState, storage: Any, device_api_factory: str | None) -> None:
    """A runtime over `storage` with the `DeviceAPI` the factory names (None: the default), in place of the
    engine's current one, which stays as it was if this raises."""
    device_api = None
    if device_api_factory is not None:
        device_api = resolve_device_api(device_api_factory, storage.device)
    link = owner_rows.DEFAULT_LINKS.get(storage.device.type, owner_rows.DEFAULT_LINKS["cuda"])
    attention, comm = owner_rows.attention_shape(state.vllm_config.model_config), state.comm
    runtime = KVPPRuntime.create(state.plan, storage, comm.group, agreement_group=comm.agreement_group,
                                 exchange_group=comm.exchange_group, device_api=device_api, attention=attention,
                                 link=link)
    # The MLA hooks exchange the decode rows of every target layer, whichever graph runs it.
    runtime.note_routing(state.plan.target_layers, state.attention.owner_blocker is None)
    if comm.runtime is not None:
        comm.runtime.close()
    comm.runtime, comm.device_api_factory = runtime, device_api_factory
    state.counters.note_new_runtime()


def set_device_api(state: EngineState, factory: str | None) -> None:
    """Rebuild the runtime over the same cache with the `DeviceAPI` that `factory` names."""
    if state.comm.runtime is None:
        raise KVPPAllocationError("kvpp_set_device_api before KVPP allocated the KV cache.")
    create_runtime(state, state.comm.runtime.storage, factory)
    logger.warning("KVPP: runtime rebuilt with device API %s.", factory or "default")


def self_check(runner: Any, state: EngineState, kv_cache_config: Any) -> None:
    """Every cache layer is bound to its KVPP view, and vLLM plans at most the budget's blocks."""
    if state.comm.runtime is None:
        raise KVPPAllocationError("vLLM allocated its KV cache without KVPP's allocator "
                                  "(allocate_kv_cache was not called).")
    storage, budget_blocks = state.comm.runtime.storage, state.layout.budget_blocks
    # vLLM gives every worker the smallest count any worker's budget holds (pipeline stages differ), so
    # fewer blocks than this worker's budget is fine; more would not fit.
    if budget_blocks is not None and kv_cache_config.num_blocks > budget_blocks:
        raise KVPPAllocationError(
            f"vLLM planned {kv_cache_config.num_blocks} blocks, the KVPP budget holds {budget_blocks} "
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


def connect(state: EngineState, device: Any) -> None:
    """This rank's KVPP groups, made once per engine, before vLLM measures the memory its KV cache may take
    (the worker's ``determine_available_memory``). A communicator allocates its buffers at its first
    collective (NCCL: per channel and peer; P2P connections per pair at the first send between them), so
    each kind the runtime issues runs once here: on the group, a broadcast and the max all-reduce of each
    forward's device checks; with owner rows, on the exchange group, a gather to, a scatter from and a
    broadcast from every rank (owner mode's exchanges, prefill history chunks). vLLM's measurement then
    holds those buffers."""
    comm = state.comm
    if comm.group is not None:
        return
    import torch.distributed as dist

    comm.group, comm.agreement_group, comm.exchange_group, comm.group_ranks = kvpp_group(
        state.config, exchanges=state.attention.owner_blocker is None)
    group, one = comm.group, torch.zeros(1, device=device)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    dist.broadcast(one, src=dist.get_global_rank(group, 0), group=group)
    dist.all_reduce(one, op=dist.ReduceOp.MAX, group=group)  # `Forward._leave_device_checks` on a device
    if comm.exchange_group is not None:
        exchange = comm.exchange_group
        for owner in range(size):
            parts = [torch.zeros_like(one) for _ in range(size)] if owner == me else None
            dist.gather(one, parts, dst=dist.get_global_rank(exchange, owner), group=exchange)
            dist.scatter(one, parts, src=dist.get_global_rank(exchange, owner), group=exchange)
            dist.broadcast(one, src=dist.get_global_rank(exchange, owner), group=exchange)


def kvpp_group(config: Any, exchanges: bool):
    """This rank's KVPP group: TP x PCP ranks from `kvpp_groups`, as a process group of its own (the
    world's backend); a gloo group of the same ranks for the runtime's per-forward agreement, which then
    needs no device synchronisation; and, where decode rows can go to their owners, a third group of the
    same ranks (the world's backend) for the owner exchanges, so that a layer's exchange never queues
    behind the next layer's broadcast on one communicator."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    from kvpp_fx.topology import create_kvpp_process_groups, group_of, kvpp_groups

    world = dist.get_world_size()
    groups = kvpp_groups(world, tp=config.tp, pcp=config.pcp, pp=world // config.size)
    mine = group_of(dist.get_rank(), groups)
    if not set(get_tp_group().ranks) <= set(mine):
        raise ValueError(f"vLLM's TP group {list(get_tp_group().ranks)} is not inside the KVPP group {mine}.")
    group = create_kvpp_process_groups(groups)
    agreement = create_kvpp_process_groups(groups, backend="gloo")
    exchange = create_kvpp_process_groups(groups) if exchanges else None
    return group, agreement, exchange, mine


def persistent_views(state: EngineState) -> list[torch.Tensor]:
    """This rank's vLLM cache views that index the pool: its owned layers' and the drafts'."""
    runtime, vplan = state.comm.runtime, state.vplan
    return [runtime.storage.typed_views(index)[vplan.component[name]] for name, index in vplan.layer_index.items()
            if state.plan.is_local(index, runtime.rank)]


def zero_persistent_blocks(state: EngineState, block_ids: list[int]) -> None:
    """vLLM's zeroing of freshly allocated blocks, on the views that index the pool. A compact slot
    holds S positions of copies each step rewrites, never uninitialized memory (it is allocated
    zeroed)."""
    for view in persistent_views(state):
        view[torch.as_tensor(block_ids, dtype=torch.long, device=view.device)] = 0
