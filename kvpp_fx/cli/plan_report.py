"""The capacity report behind ``kvpp-fx plan``: the `KVPPPlan` of a model (`build_plan`) and a plain dict of
its numbers per rank (`plan_report`), with what a vLLM engine adds to it: the slots each MLA backend takes
(`vllm_backends`), the whole-layer steps where owner rows cannot be used (`vllm_whole_layer_steps`) and the
owner-mode exchange reserve (`exchange_reserve`). The step's transfer cost is `kvpp_fx.cli.step_cost`'s, the
table `kvpp_fx.cli.plan_table`'s.
"""

from __future__ import annotations

from typing import Any

from kvpp_fx.cache.cost import AttentionShape, max_decode_rows
from kvpp_fx.cache.placement import UNBOUNDED_BLOCKS, KVPPPlan
from kvpp_fx.cache.spec import ModelCacheSpec, load_hf_config
from kvpp_fx.cli.byte_sizes import format_bytes


def layer_ranges(layers: tuple[int, ...] | list[int]) -> str:
    """[0,1,2,5,6] -> '0-2,5-6'; [] -> '-'."""
    if not layers:
        return "-"
    parts, start, prev = [], layers[0], layers[0]
    for i in list(layers[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


# vLLM's max_num_batched_tokens when chunked prefill is on and nothing else sets it (a serving default).
DEFAULT_TOKEN_BUDGET = 8192


def build_plan(model: str, *, tp: int, pcp: int = 1, block_size: int = 128, kv_dtype: str = "bf16",
               mtp: bool = False, shard_draft: bool = False, depth: int = 2, max_model_len: int | None = None,
               token_budget: int | None = None, scratch_blocks: int | None = None) -> KVPPPlan:
    """The plan of a preset or HF config. With `max_model_len` the scratch slots are compact (S blocks
    from it and the token budget, `DEFAULT_TOKEN_BUDGET` unless given); `scratch_blocks` sets S."""
    name, config = load_hf_config(model)
    spec = ModelCacheSpec.from_hf_config(config, name=name, block_size=block_size, kv_dtype=kv_dtype,
                                         include_mtp=mtp)
    if max_model_len is not None and token_budget is None:
        token_budget = DEFAULT_TOKEN_BUDGET
    return KVPPPlan.for_requests(spec, tp * pcp, max_model_len=max_model_len, token_budget=token_budget,
                                 scratch_blocks=scratch_blocks, depth=depth, shard_draft_layers=shard_draft)


class KVMemoryTooSmallError(ValueError):
    """The KV memory per rank holds no block on some rank, with KVPP or replicated."""


def min_kv_memory(plan: KVPPPlan) -> int:
    """The least KV memory per rank that holds one block on every rank, with KVPP and replicated."""
    def fits(n: int) -> bool:
        return plan.num_blocks(n) >= 1 and plan.replicated_num_blocks(n) >= 1

    high = 1
    while not fits(high):
        high *= 2
    low = high // 2  # does not fit (or is 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def plan_report(plan: KVPPPlan, available_bytes: int, *, max_model_len: int | None = None,
                token_budget: int | None = None) -> dict[str, Any]:
    block_size = plan.spec.block_size
    blocks = plan.num_blocks(available_bytes)
    if blocks == 0 or plan.replicated_num_blocks(available_bytes) == 0:
        short = min(range(plan.group_size), key=lambda r: plan.num_blocks(available_bytes, r))
        where = f"rank {short}" if blocks == 0 else "a replicated rank"
        raise KVMemoryTooSmallError(
            f"KV memory {format_bytes(available_bytes)} per rank holds no block of {block_size} tokens on {where}; "
            f"the minimum is {format_bytes(min_kv_memory(plan))} ({min_kv_memory(plan):,} bytes) per rank.")
    plan.check_pool(blocks)
    ranks = []
    for rank in range(plan.group_size):
        rank_blocks = plan.num_blocks(available_bytes, rank)
        if rank_blocks == UNBOUNDED_BLOCKS:  # only compact slots: the group's pool is the other ranks' bound
            rank_blocks = blocks
        ranks.append({
            "rank": rank,
            "owned_layers": list(plan.owned_layers(rank)),
            "owned_ranges": layer_ranges(plan.owned_layers(rank)),
            "local_draft_layers": list(plan.local_draft_layers),
            "persistent_bytes_per_block": plan.persistent_bytes_per_block(rank),
            "scratch_bytes_per_block": plan.scratch_bytes_per_block(rank),
            "scratch_fixed_bytes": plan.fixed_bytes(rank),
            "bytes_per_block": plan.persistent_bytes_per_block(rank) + plan.scratch_bytes_per_block(rank),
            "blocks": rank_blocks,
            "tokens": rank_blocks * block_size,
            "allocated_bytes": plan.bytes_for(rank_blocks, rank),
        })
    replicated_blocks = plan.replicated_num_blocks(available_bytes)
    worst = min(ranks, key=lambda r: r["blocks"])
    report: dict[str, Any] = {
        "model": plan.spec.name,
        "group_size": plan.group_size,
        "block_size": block_size,
        "depth": plan.depth,
        "kv_memory_bytes": available_bytes,
        "target_layers": list(plan.target_layers),
        "draft_layers": list(plan.spec.draft_layers),
        "shard_draft_layers": plan.shard_draft_layers,
        "ranks": ranks,
        "replicated": {
            "blocks": replicated_blocks,
            "tokens": replicated_blocks * block_size,
            "bytes_per_block": sum(b.bytes_per_block for b in plan.replicated_buffers()),
        },
        "engine_blocks": blocks,
        "worst_rank": worst["rank"],
        "capacity_ratio": plan.capacity_ratio(available_bytes),
        "formula_capacity_ratio": plan.formula_capacity_ratio(available_bytes),
        "max_model_len": max_model_len,
        "token_budget": token_budget if max_model_len is not None else None,
        "scratch": {
            "compact": plan.compact,
            "slot_blocks": plan.slot_blocks(blocks),
            "slot_tokens": plan.slot_blocks(blocks) * block_size,
            "request_blocks": plan.request_blocks,
            "slot_bytes": plan.fixed_bytes(worst["rank"]) // plan.depth if plan.compact else None,
        },
        "capacity_ratio_whole_layer_slots": plan.whole_layer().capacity_ratio(available_bytes),
        "broadcast_bytes_per_forward": plan.broadcast_bytes_per_forward(blocks),
    }
    if plan.shard_draft_layers and plan.spec.draft_layers:
        unsharded = plan.with_(shard_draft_layers=False)
        base = unsharded.num_blocks(available_bytes)
        report["draft_sharding_gain"] = blocks / base if base else None
    if plan.compact:
        report["vllm_backends"] = vllm_backends(plan, available_bytes)
        # What the per-backend rows assume: vLLM's defaults, whose prefill history streams from the owners.
        report["vllm_config"] = {"chunked_prefill": True, "prefix_caching": True,
                                 "speculative": "mtp" if plan.spec.draft_layers else None,
                                 "prefill_history": "streamed from each layer's owner"}
    return report


def vllm_backends(plan: KVPPPlan, available_bytes: int) -> dict[str, dict[str, Any]]:
    """Per vLLM MLA backend: whether its decode rows go to their owners, hence the slots vLLM takes with it
    (compact where they can: prefill history streams from the owners, under vLLM's defaults too) and the
    capacity at this plan's block size. With an fp8 cache, the backends that quantize their queries for it
    exchange them quantized (`backends`)."""
    # The command line sits above the integrations (docs/design.md's layers), so it may import one.
    from kvpp_fx.integrations.vllm.attention.backends import BACKENDS, owner_blocker

    fp8 = any(c.dtype in ("uint8", "float8_e4m3fn") for layer in plan.spec.layers for c in layer.components)
    out = {}
    for name, support in BACKENDS.items():
        if support.sparse:  # a plugin's sparse backend (`register_owner_backend`): not a dense MLA model's
            continue
        if fp8 and support.fp8_cache == "none":
            out[name] = {"owner_rows": False, "slots": None, "capacity_ratio": None,
                         "why": f"{name} has no fp8 KV cache in vLLM 0.32", "vllm_block_size": support.block_size,
                         "queries": None}
            continue
        why = owner_blocker(name)
        chosen = plan if why is None else plan.whole_layer()
        how = support.how + ("; its fp8 queries travel quantized" if fp8 and support.fp8_cache == "quantized queries"
                             else "")
        out[name] = {"owner_rows": why is None, "slots": "compact" if why is None else "whole-layer",
                     "capacity_ratio": chosen.capacity_ratio(available_bytes), "why": why or how,
                     "vllm_block_size": support.block_size, "queries": support.fp8_cache if fp8 else None}
    return out


def vllm_whole_layer_steps(plan: KVPPPlan, available_bytes: int, *, sparse: bool, pcp: int,
                           link_gb_per_s: float, owner_shape: AttentionShape | None = None) -> dict[str, Any] | None:
    """Where kvpp-fx's vLLM integration broadcasts whole layers on every step, decode steps included: SFA
    models (vLLM's sparse and indexer metadata hold block ids KVPP does not remap) and prefill context
    parallelism (each rank's metadata holds only its part of the batch). Decode rows cannot go to their owners
    there, so vLLM's slots are whole layers whatever ``plan`` chose: the blocks, capacity and bytes are the
    whole-layer plan's. None elsewhere.

    For an SFA model without PCP, also what owner-only slots give on a sparse backend that runs owner calls
    (`vllm_owner_only`, given the model's ``owner_shape``)."""
    reasons = []
    if sparse:
        reasons.append("SFA: vLLM's sparse and indexer metadata are not remapped to packed slots, and vLLM's sparse "
                       "MLA backends (FlashMLA's, FlashInfer's) run no owner call yet")
    if pcp > 1:
        reasons.append("PCP: each rank's attention metadata holds only its part of the batch")
    if not reasons:
        return None
    whole = plan.whole_layer()
    blocks = whole.num_blocks(available_bytes)
    per_step = whole.broadcast_bytes_per_forward(blocks)
    out = {"reasons": reasons, "slots": "whole-layer", "engine_blocks": blocks,
           "capacity_ratio": whole.capacity_ratio(available_bytes), "bytes_per_step": per_step,
           "link_gb_per_s": link_gb_per_s, "seconds_per_step": per_step / (link_gb_per_s * 1e9)}
    if sparse and pcp == 1 and owner_shape is not None:
        out["owner_only"] = vllm_owner_only(plan, available_bytes, owner_shape)
    return out


def vllm_owner_only(plan: KVPPPlan, available_bytes: int, shape: AttentionShape) -> dict[str, Any]:
    """An SFA model's owner-only slots in vLLM (`integrations/vllm/cache/scratch.py`), where its sparse backend
    runs owner calls: each rank holds its own layers beside a slot of one block, and every row goes to its
    layers' owners, so a decode step moves its tokens' queries and outputs, whatever their context: per layer
    and decode token, what the owner's link carries (`AttentionShape.owner_bytes_per_layer`)."""
    from kvpp_fx.integrations.vllm.cache.scratch import OWNER_ONLY_SLOT_BLOCKS

    owner_only = plan.with_(scratch_blocks=OWNER_ONLY_SLOT_BLOCKS, request_blocks=None)
    return {"needs": "a sparse MLA backend that runs owner calls on every token: none of vLLM's GPU ones yet (a "
                     "plugin's, declared with register_owner_backend and routes_every_token)",
            "slot_blocks": OWNER_ONLY_SLOT_BLOCKS, "engine_blocks": owner_only.num_blocks(available_bytes),
            "capacity_ratio": owner_only.capacity_ratio(available_bytes),
            "owner_bytes_per_layer_and_token": shape.owner_bytes_per_layer(1, plan.group_size)}


def exchange_reserve(plan: KVPPPlan, shape: AttentionShape, available_bytes: int, *, max_num_seqs: int,
                     speculative_tokens: int, token_budget: int) -> dict[str, Any]:
    """What a vLLM engine on a GPU keeps out of KVPP's KV budget for owner-mode exchanges: one owner call's
    peak (`AttentionShape.owner_exchange_peak_bytes`) for the most decode rows a step has, and the
    capacity ratio after it. KVPP's communicators are made and used once before vLLM measures the memory
    left for the KV cache, so vLLM's measurement holds their buffers and nothing is kept for them here."""
    rows = max_decode_rows(max_num_seqs, speculative_tokens, token_budget)
    peak = shape.owner_exchange_peak_bytes(rows, plan.group_size)
    replicated = plan.replicated_num_blocks(available_bytes)
    blocks = plan.num_blocks(max(available_bytes - peak, 0))
    return {"decode_rows": rows, "max_num_seqs": max_num_seqs, "speculative_tokens": speculative_tokens,
            "bytes": peak, "engine_blocks": blocks, "capacity_ratio": blocks / replicated if replicated else None}
