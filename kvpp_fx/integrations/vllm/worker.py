"""KVPP inside vLLM's worker (eager path): budget, cache allocation, per-step forward, attention hook.

Installed by the plugin in every vLLM process; each hook does nothing unless the worker's config has
KVPP enabled (``additional_config.enable_kvpp`` with TP x PCP > 1), so KVPP off changes nothing.

- Budget: ``determine_available_memory`` returns the *logical* budget ``plan.num_blocks(avail) x sum of
  the layers' page sizes``, so vLLM's unchanged planner lands on the block count KVPP can hold.
- Allocation: ``allocate_kv_cache`` (as the model runner calls it) returns our allocator's views:
  the persistent bundle for owned layers, a scratch slot for the others. vLLM binds them by layer name.
- Steps: ``execute_model`` runs under ``runtime.forward(has_history)``, with
  ``has_history = any(num_computed_tokens > 0)`` over the scheduled requests. Dummy and profile runs
  never enter it, so they broadcast nothing.
- Eager attention: ``MLAAttention.forward`` waits for its layer and prefetches the next one first.
- Compiled graphs (see `compilation`): dummy, profile and warm-up runs go through the rewritten graph
  before any cache exists, so ``_dummy_run`` runs with the kvpp ops in passthrough.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.config import KVPPConfig
from kvpp_fx.ops import passthrough
from kvpp_fx.passes.registry import LAYER_NAME_PATTERN
from kvpp_fx.runtime.runtime import KVPPRuntime, active_runtime

logger = logging.getLogger(__name__)

_PATCHED = "_kvpp_fx_hook"

_TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                      torch.int8: "int8", torch.uint8: "uint8"}


@dataclass
class WorkerState:
    config: KVPPConfig | None = None
    runtime: KVPPRuntime | None = None
    layer_index: dict[str, int] = field(default_factory=dict)
    runner: Any = None
    group: Any = None
    group_ranks: list[int] = field(default_factory=list)


STATE = WorkerState()


def layer_index(name: str) -> int:
    match = LAYER_NAME_PATTERN.search(name)
    if match is None:
        raise ValueError(f"cannot read a layer index from vLLM layer name {name!r}.")
    return int(match.group(1))


def plan_from_specs(specs: dict[str, Any], group_size: int) -> tuple[KVPPPlan, dict[str, int]]:
    """A plan from vLLM's per-layer KV cache specs (one MLA latent component per layer)."""
    names = {name: layer_index(name) for name in specs}
    layers, block_size = [], None
    for name, spec in specs.items():
        block_size = spec.block_size
        dtype = _TORCH_DTYPE_NAMES[spec.dtype]
        width = spec.head_size * getattr(spec, "num_kv_heads", 1)
        layers.append(LayerCacheSpec(names[name], (ComponentSpec("kv", dtype, (width,)),)))
    spec = ModelCacheSpec("vllm", block_size, tuple(sorted(layers, key=lambda l: l.index)))
    return KVPPPlan(spec, group_size=group_size), names


def _kvpp_group(config: KVPPConfig):
    """This rank's KVPP group: TP x PCP ranks from `kvpp_groups`, as a process group of its own."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    from kvpp_fx.topology import create_kvpp_process_groups, group_of, kvpp_groups

    world = dist.get_world_size()
    groups = kvpp_groups(world, tp=config.tp, pcp=config.pcp, pp=world // config.size)
    mine = group_of(dist.get_rank(), groups)
    if not set(get_tp_group().ranks) <= set(mine):
        raise ValueError(f"vLLM's TP group {list(get_tp_group().ranks)} is not inside the KVPP group {mine}.")
    return create_kvpp_process_groups(groups), mine


def _patch(owner: Any, name: str, make) -> None:
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return
    wrapper = make(original)
    setattr(wrapper, _PATCHED, True)
    setattr(owner, name, wrapper)


def install() -> None:
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.v1.worker import cpu_worker, gpu_model_runner

    def budget(original):
        @functools.wraps(original)
        def determine_available_memory(self) -> int:
            # Set first: the warm-up inside vLLM's own function compiles the graph (see `compilation`).
            STATE.config = config = KVPPConfig.from_vllm_config(self.vllm_config)
            available = original(self)
            if not config.enabled:
                return available
            specs = self.model_runner.get_kv_cache_spec()
            plan, _ = plan_from_specs(specs, config.size)
            blocks = plan.num_blocks(available)
            logical = blocks * sum(spec.page_size_bytes for spec in specs.values())
            replicated = plan.replicated_num_blocks(available)
            logger.warning("KVPP: %d blocks per rank in %d bytes (replicated: %d); logical budget %d bytes.",
                           blocks, available, replicated, logical)
            return logical
        return determine_available_memory

    def remember_runner(original):
        @functools.wraps(original)
        def initialize_kv_cache_tensors(self, kv_cache_config, *args, **kwargs):
            STATE.runner = self
            return original(self, kv_cache_config, *args, **kwargs)
        return initialize_kv_cache_tensors

    def allocation(original):
        @functools.wraps(original)
        def allocate_kv_cache(kv_cache_config, device, *args, **kwargs):
            runner = STATE.runner
            config = KVPPConfig.from_vllm_config(runner.vllm_config) if runner is not None else None
            if config is None or not config.enabled:
                return original(kv_cache_config, device, *args, **kwargs)
            specs = {name: group.kv_cache_spec for group in kv_cache_config.kv_cache_groups
                     for name in group.layer_names}
            plan, names = plan_from_specs(specs, config.size)
            if STATE.group is None:
                STATE.group, STATE.group_ranks = _kvpp_group(config)
            rank = torch.distributed.get_rank(STATE.group)
            storage = allocate_cache(plan, rank, kv_cache_config.num_blocks, device)
            if STATE.runtime is not None:
                STATE.runtime.close()
            STATE.runtime = KVPPRuntime.create(plan, storage, STATE.group)
            STATE.layer_index = names
            logger.warning("KVPP: group %s, rank %d owns layers %s of %d; %d blocks; %d bytes allocated.",
                           STATE.group_ranks, rank, list(plan.owned_layers(rank)), len(plan.target_layers),
                           kv_cache_config.num_blocks, storage.allocated_bytes)
            return {name: storage.typed_views(index)["kv"] for name, index in names.items()}
        return allocate_kv_cache

    def step(original):
        @functools.wraps(original)
        def execute_model(self, scheduler_output, *args, **kwargs):
            runtime = STATE.runtime
            if runtime is None or scheduler_output.total_num_scheduled_tokens == 0:
                return original(self, scheduler_output, *args, **kwargs)
            computed = [r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs]
            computed += list(scheduler_output.scheduled_cached_reqs.num_computed_tokens)
            with runtime.forward(has_history=any(n > 0 for n in computed)):
                return original(self, scheduler_output, *args, **kwargs)
        return execute_model

    def attention(original):
        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            # Traced by Dynamo in the compiled path, where the graph pass places the ops instead.
            if not torch.compiler.is_compiling():
                runtime = active_runtime()
                if runtime is not None:
                    wait_for_layer(runtime, STATE.layer_index[self.layer_name])
            return original(self, *args, **kwargs)
        return forward

    def dummy(original):
        @functools.wraps(original)
        def _dummy_run(self, *args, **kwargs):
            with passthrough():
                return original(self, *args, **kwargs)
        return _dummy_run

    _patch(cpu_worker.CPUWorker, "determine_available_memory", budget)
    _patch(gpu_model_runner.GPUModelRunner, "initialize_kv_cache_tensors", remember_runner)
    _patch(gpu_model_runner, "allocate_kv_cache", allocation)
    _patch(gpu_model_runner.GPUModelRunner, "execute_model", step)
    _patch(mla_attention.MLAAttention, "forward", attention)
    _patch(gpu_model_runner.GPUModelRunner, "_dummy_run", dummy)


def wait_for_layer(runtime: KVPPRuntime, layer: int) -> None:
    """What the graph pass inserts, done at the layer's attention entry: prefetch(first) at the first
    layer, then wait(layer) and prefetch(next)."""
    plan = runtime.plan
    if layer == plan.target_layers[0]:
        runtime.prefetch(layer, plan.slot(layer))
    runtime.wait(layer, plan.slot(layer))
    nxt = plan.next_target(layer)
    if nxt is not None:
        runtime.prefetch(nxt, plan.slot(nxt))


def worker_stats(worker: Any = None) -> dict[str, Any] | None:
    """For ``llm.collective_rpc(worker_stats)``: this worker's KVPP counters and allocation."""
    runtime = STATE.runtime
    if runtime is None:
        return None
    stats = runtime.stats()
    stats["num_blocks"] = runtime.storage.num_blocks
    stats["owned_layers"] = list(runtime.plan.owned_layers(runtime.rank))
    from kvpp_fx.integrations.vllm.compilation import REWRITTEN_GRAPHS

    stats["rewritten_graphs"] = [list(layers) for layers in REWRITTEN_GRAPHS]
    return stats
