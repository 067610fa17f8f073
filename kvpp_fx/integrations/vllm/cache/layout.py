"""The budget a KVPP worker gives vLLM's planner, the scratch layout behind it, and the engine's plan
(`Layout`): the loaded model's, then the budget's, then that of vLLM's KV cache config.

Invariant: ``budget(...)`` returns the *logical* bytes ``plan.num_blocks(available) x the sum of
vLLM's page sizes``, so vLLM's unchanged planner lands on the block count KVPP can hold; the layout
(compact or whole-layer slots, `scratch.choose_plan`) is chosen from the smallest budget of the group,
so every rank chooses alike. Runner-agnostic: it reads the runner's ``get_kv_cache_spec`` and
``model_config`` only, which both of vLLM's model runners have.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvpp_fx.integrations.vllm.cache import scratch
from kvpp_fx.integrations.vllm.cache.specs import VllmPlan, per_layer_specs, plan_from_specs
from kvpp_fx.integrations.vllm.engine.state import EngineState, KVPPAllocationError

logger = logging.getLogger(__name__)


def num_target_layers(runner: Any) -> int:
    """The target model's layer count: MTP layers are numbered from it."""
    hf = runner.model_config.hf_text_config
    return int(getattr(hf, "num_hidden_layers"))


def plan_for(runner: Any, state: EngineState, specs: dict[str, Any], scratch_blocks: int | None = None) -> VllmPlan:
    """The plan of `specs` (vLLM's per-layer cache specs) for this engine, with slots of
    `scratch_blocks` blocks (None: whole layers)."""
    # Only compact slots bound the pool below by a max-length request: whole-layer plans take any pool
    # vLLM plans, the small ones of CUDA graph memory profiling included.
    max_model_len = None if scratch_blocks is None else int(runner.model_config.max_model_len)
    return plan_from_specs(specs, state.config.size, num_target_layers(runner), scratch_blocks=scratch_blocks,
                           max_model_len=max_model_len)


def plan_loaded_model(runner: Any, state: EngineState) -> None:
    """The whole-layer plan of the loaded model's cache specs, which its attention hooks read."""
    state.layout.vplan = plan_for(runner, state, runner.get_kv_cache_spec())


def budget(runner: Any, state: EngineState, available: int) -> int:
    """The logical KV budget for vLLM's planner, from this worker's `available` bytes less what KVPP
    allocates after vLLM's measurement (the owner-mode exchanges' peak, streamed history's prefetch
    buffer); picks the layout."""
    exchanges = exchange_reserve(runner.vllm_config, state, runner.device)
    history = history_reserve(runner.vllm_config, state, runner.device)
    reserve = exchanges + history
    if reserve >= available:
        raise KVPPAllocationError(
            f"KVPP's owner-mode exchanges need up to {exchanges} bytes per rank at their peak (decode rows of "
            f"max_num_seqs requests, every rank's heads on the owner), and streamed prefill history's prefetch "
            f"buffer {history} bytes: more than the {available} bytes vLLM left for the KV cache. Lower "
            "max_num_seqs (or max_model_len) or raise gpu_memory_utilization.")
    available -= reserve
    vplan = choose_layout(runner, state, available)
    blocks = vplan.plan.num_blocks(available)
    state.layout.budget_blocks = blocks
    logical = blocks * vplan.logical_bytes_per_block
    logger.warning("KVPP: %d blocks per rank in %d bytes (without KVPP: %d; %s; %d bytes kept for owner-mode "
                   "exchanges, %d for streamed history's prefetch buffer); logical budget %d bytes.", blocks,
                   available, (available + reserve) // vplan.logical_bytes_per_block, state.layout.scratch_choice,
                   exchanges, history, logical)
    return logical


def exchange_reserve(vllm_config: Any, state: EngineState, device: Any) -> int:
    """The device memory one layer's owner-mode exchange holds at its peak on the owner
    (`AttentionShape.owner_exchange_peak_bytes`) for the most decode rows a step can have (``max_num_seqs``
    requests, each with its speculative tokens, within the token budget; for an SFA model, whose steps send
    every row to the owners, prefill rows included, the whole token budget); vLLM's profile run does not
    exchange, so its measurement of the memory left never saw these bytes. 0 where decode rows never go to
    the owner, and on CPU, where vLLM's KV budget is a fixed space (``VLLM_CPU_KVCACHE_SPACE``) that the
    exchanges do not draw from."""
    if state.config.size == 1 or state.attention.owner_blocker is not None or torch.device(device).type == "cpu":
        return 0
    from kvpp_fx.cache.cost import max_decode_rows
    from kvpp_fx.integrations.vllm.attention.owner_rows import attention_shape

    scheduler = vllm_config.scheduler_config
    speculative = getattr(vllm_config, "speculative_config", None)
    rows = max_decode_rows(int(scheduler.max_num_seqs), int(getattr(speculative, "num_speculative_tokens", 0) or 0),
                           int(scheduler.max_num_batched_tokens))
    if scratch.owner_only(vllm_config):
        rows = int(scheduler.max_num_batched_tokens)
    return attention_shape(vllm_config.model_config).owner_exchange_peak_bytes(rows, state.config.size)


def history_reserve(vllm_config: Any, state: EngineState, device: Any) -> int:
    """The device memory of streamed prefill history's prefetch buffer (`ContextRows`): one more of vLLM's
    MLA context workspaces (its rows from vLLM's own sizing, `kv_lora_rank + rope` values of the query's
    dtype, bfloat16 under fp8_ds_mla), allocated at the first streamed chunk, after vLLM measured memory.
    0 where history cannot stream (no compact slots, an impl that reads history its own way), for a group
    of one, and on CPU, whose KV budget is a fixed space the buffer does not draw from."""
    choices = state.attention
    if (state.config.size == 1 or not choices.streams_history or choices.compact_blocker is not None
            or torch.device(device).type == "cpu"):
        return 0
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

    from kvpp_fx.integrations.vllm.attention.owner_rows import attention_shape

    rows = MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size(vllm_config)
    shape = attention_shape(vllm_config.model_config)
    itemsize = 2 if vllm_config.cache_config.cache_dtype == "fp8_ds_mla" else shape.itemsize
    return rows * shape.q_width * itemsize


def choose_layout(runner: Any, state: EngineState, available: int) -> VllmPlan:
    """Compact or whole-layer scratch slots for this worker's budget (`scratch.choose_plan`)."""
    specs, layout, blocker = runner.get_kv_cache_spec(), state.layout, state.attention.compact_blocker
    whole = plan_for(runner, state, specs)
    if blocker is not None:
        layout.vplan, layout.scratch_blocks, layout.owner_only = whole, None, False
        layout.scratch_choice = f"whole-layer slots: {blocker}"
        return whole
    slots = scratch.slot_blocks(runner.vllm_config, state.config, whole.plan.spec.block_size)
    # Each rank measures its own budget (vLLM CPU's default is what the process has left); the group
    # chooses from the smallest, so every rank chooses alike.
    chosen, layout.scratch_choice = scratch.choose_plan(plan_for(runner, state, specs, slots), whole,
                                                        group_minimum(available),
                                                        explicit=state.config.scratch_blocks is not None)
    layout.vplan, layout.scratch_blocks = chosen, chosen.plan.scratch_blocks
    layout.owner_only = chosen.plan.compact and scratch.owner_only(runner.vllm_config)
    if layout.owner_only:
        layout.scratch_choice = f"owner-only slots, every row of a step on its layer's owner ({layout.scratch_choice})"
    return chosen


def plan_allocation(runner: Any, state: EngineState, kv_cache_config: Any) -> VllmPlan:
    """The plan of vLLM's KV cache config, in the chosen slots; it must hold the model's cache specs."""
    vplan = plan_for(runner, state, per_layer_specs(kv_cache_config), state.layout.scratch_blocks)
    if state.vplan is not None and vplan.plan.spec != state.vplan.plan.spec:
        raise KVPPAllocationError(f"vLLM's KV cache config {vplan.plan.spec} differs from the model's cache "
                                  f"specs {state.vplan.plan.spec}.")
    state.layout.vplan = vplan
    return vplan


def group_minimum(available: int) -> int:
    """The smallest of `available` over vLLM's TP group, which is the KVPP group wherever compact slots
    can run (PCP 1; `scratch.compact_blocker`)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return available
    value = torch.tensor([available], dtype=torch.int64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    return int(value.item())
