"""The capacity report behind ``kvpp-fx plan``: a plain dict built from a `KVPPPlan`, and its table.

With ``--context-tokens`` it adds one step's transfer cost: whole-layer and active-block broadcasts,
owner-mode bytes, and the mode `kvpp_fx.cache.cost.choose_mode` picks.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kvpp_fx.cache.cost import OWNER, AttentionShape, LinkModel, StepLoad, choose_mode, max_decode_rows
from kvpp_fx.cache.placement import UNBOUNDED_BLOCKS, KVPPPlan
from kvpp_fx.cache.spec import ModelCacheSpec, load_hf_config

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """'64GiB', '40 GB', '1.5TiB', '123456' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a memory size from {text!r} (try e.g. 40GiB).")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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
    return report


def vllm_backends(plan: KVPPPlan, available_bytes: int) -> dict[str, dict[str, Any]]:
    """Per vLLM MLA backend: whether its decode rows go to their owners, hence the slots vLLM takes with it
    (compact only where every history row can go to its owner) and the capacity at this plan's block size.
    An fp8 cache keeps whole-layer slots on the backends that quantize their queries for it."""
    from kvpp_fx.integrations.vllm.backends import BACKENDS, owner_blocker

    fp8 = any(c.dtype in ("uint8", "float8_e4m3fn") for layer in plan.spec.layers for c in layer.components)
    out = {}
    for name, support in BACKENDS.items():
        if fp8 and support.fp8_cache == "none":
            out[name] = {"owner_rows": False, "slots": None, "capacity_ratio": None,
                         "why": f"{name} has no fp8 KV cache in vLLM 0.32", "vllm_block_size": support.block_size}
            continue
        why = owner_blocker(name, quantized_queries=fp8 and support.fp8_cache == "quantized queries")
        chosen = plan if why is None else plan.whole_layer()
        out[name] = {"owner_rows": why is None, "slots": "compact" if why is None else "whole-layer",
                     "capacity_ratio": chosen.capacity_ratio(available_bytes), "why": why or support.how,
                     "vllm_block_size": support.block_size}
    return out


def vllm_whole_layer_steps(plan: KVPPPlan, num_blocks: int, *, sparse: bool, pcp: int,
                           link_gb_per_s: float) -> dict[str, Any] | None:
    """Where kvpp-fx's vLLM integration broadcasts whole layers on every step, decode steps included: SFA
    models (vLLM's sparse and indexer metadata hold block ids KVPP does not remap) and prefill context
    parallelism (each rank's metadata holds only its part of the batch). None elsewhere."""
    reasons = []
    if sparse:
        reasons.append("SFA: vLLM's sparse and indexer metadata are not remapped to packed slots, and SFA has no "
                       "owner rows yet")
    if pcp > 1:
        reasons.append("PCP: each rank's attention metadata holds only its part of the batch")
    if not reasons:
        return None
    per_step = plan.broadcast_bytes_per_forward(num_blocks)
    return {"reasons": reasons, "bytes_per_step": per_step, "link_gb_per_s": link_gb_per_s,
            "seconds_per_step": per_step / (link_gb_per_s * 1e9)}


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


def transfer_cost(plan: KVPPPlan, num_blocks: int, context_tokens: int, link_gb_per_s: float) -> dict[str, Any]:
    """Bytes and link time per layer and per forward for a step that reads `context_tokens` tokens.

    The step reads ``ceil(context_tokens / block_size)`` blocks (its requests' contexts packed into
    whole blocks, a lower bound), capped at the pool. Whole-layer broadcasts move every block of every
    target layer; active-block broadcasts move the read blocks and their ids, unless the set exceeds
    the crossover fraction of whole-layer slots, where the runtime sends whole layers too. With compact
    slots a set wider than a slot takes the owner path (its rows go to their owners).
    """
    if context_tokens < 0 or link_gb_per_s <= 0:
        raise ValueError("context tokens must be >= 0 and the link bandwidth > 0.")
    active = min(num_blocks, -(-context_tokens // plan.spec.block_size))
    uses_active = plan.uses_active_blocks(active, num_blocks)
    fits = active <= plan.slot_blocks(num_blocks)
    per_layer_whole = [num_blocks * plan.bundle_bytes_per_block(i) for i in plan.target_layers]
    per_layer_active = ([plan.active_broadcast_bytes(i, active) for i in plan.target_layers] if uses_active
                        else per_layer_whole)
    bandwidth = link_gb_per_s * 1e9
    whole, act = sum(per_layer_whole), sum(per_layer_active)
    return {
        "context_tokens": context_tokens, "active_blocks": active, "pool_blocks": num_blocks,
        "active_fraction": active / num_blocks if num_blocks else 0.0, "link_gb_per_s": link_gb_per_s,
        "path": ("active-block" if uses_active and fits else "owner" if uses_active else "whole-layer"),
        "fits_slot": fits,
        "whole_layer": {"bytes_per_layer": max(per_layer_whole, default=0), "bytes_per_forward": whole,
                        "seconds_per_layer": max(per_layer_whole, default=0) / bandwidth,
                        "seconds_per_forward": whole / bandwidth},
        "active_block": {"bytes_per_layer": max(per_layer_active, default=0), "bytes_per_forward": act,
                         "seconds_per_layer": max(per_layer_active, default=0) / bandwidth,
                         "seconds_per_forward": act / bandwidth},
    }


def format_plan_table(report: dict[str, Any]) -> str:
    lines = [
        f"KVPP plan: {report['model']}  group={report['group_size']}  block_size={report['block_size']}"
        f"  kv_memory={format_bytes(report['kv_memory_bytes'])}  scratch depth={report['depth']}",
        f"target layers: {len(report['target_layers'])} ({layer_ranges(report['target_layers'])})"
        f"  draft layers: {layer_ranges(report['draft_layers'])}"
        + (" (sharded)" if report["shard_draft_layers"] and report["draft_layers"] else
           " (local on every rank)" if report["draft_layers"] else ""),
        "",
        f"{'rank':>4}  {'owned layers':<16} {'persist B/blk':>14} {'scratch B/blk':>14} {'scratch fixed':>14} "
        f"{'blocks':>10} {'tokens':>12}",
    ]
    for r in report["ranks"]:
        owned = f"{r['owned_ranges']} ({len(r['owned_layers'])})"
        lines.append(
            f"{r['rank']:>4}  {owned:<16} {r['persistent_bytes_per_block']:>14,} "
            f"{r['scratch_bytes_per_block']:>14,} {format_bytes(r['scratch_fixed_bytes']):>14} {r['blocks']:>10,} "
            f"{r['tokens']:>12,}"
        )
    rep, scratch = report["replicated"], report["scratch"]
    if scratch["compact"]:
        bound = (f"max_model_len {report['max_model_len']:,} + token budget {report['token_budget']:,}"
                 if report["max_model_len"] is not None else "scratch_blocks")
        slots = (f"scratch slots: {report['depth']} x {scratch['slot_blocks']:,} blocks "
                 f"({scratch['slot_tokens']:,} tokens, {format_bytes(scratch['slot_bytes'])} each), from {bound}")
    else:
        slots = "scratch slots: whole layers (give --max-model-len for compact slots)"
    lines += [
        f"{'repl':>4}  {'all':<16} {rep['bytes_per_block']:>14,} {0:>14,} {format_bytes(0):>14} {rep['blocks']:>10,} "
        f"{rep['tokens']:>12,}",
        "",
        f"capacity ratio (worst rank {report['worst_rank']}): {report['capacity_ratio']:.3f}x"
        f"   formula: {report['formula_capacity_ratio']:.3f}x"
        f"   with whole-layer slots: {report['capacity_ratio_whole_layer_slots']:.3f}x",
        slots,
        f"broadcast per forward at full occupancy: {format_bytes(report['broadcast_bytes_per_forward'])}",
    ]
    cost = report.get("transfer_cost")
    if cost is not None:
        gbps = cost["link_gb_per_s"]
        lines += [
            "",
            f"transfer for a step reading {cost['context_tokens']:,} tokens = {cost['active_blocks']:,} blocks "
            f"({cost['active_fraction']:.1%} of the pool) at {gbps:g} GB/s: {cost['path']} path"
            + ("" if cost["fits_slot"] else " (more blocks than a scratch slot holds)"),
            f"{'':>14} {'bytes/layer':>14} {'ms/layer':>10} {'bytes/forward':>15} {'ms/forward':>11}",
        ]
        for key, label in (("whole_layer", "whole-layer"), ("active_block", "active-block")):
            c = cost[key]
            lines.append(f"{label:>14} {format_bytes(c['bytes_per_layer']):>14} {c['seconds_per_layer'] * 1e3:>10.3f} "
                         f"{format_bytes(c['bytes_per_forward']):>15} {c['seconds_per_forward'] * 1e3:>11.2f}")
        owner = cost.get("owner_mode")
        if owner is not None:
            lines.append(f"{'owner mode':>14} {format_bytes(owner['bytes_per_layer']):>14} "
                         f"{owner['seconds_per_layer'] * 1e3:>10.3f} {format_bytes(owner['bytes_per_forward']):>15} "
                         f"{owner['seconds_per_forward'] * 1e3:>11.2f}")
            lines += _format_mode_choice(cost)
        if "owner_mode_unavailable" in cost:
            lines.append(f"owner mode: not available ({cost['owner_mode_unavailable']})")
    reserve = report.get("exchange_reserve")
    if reserve is not None:
        lines += ["", f"owner-mode exchanges keep {format_bytes(reserve['bytes'])} out of the KV budget on a GPU "
                      f"({reserve['decode_rows']:,} decode rows: {reserve['max_num_seqs']:,} requests x "
                      f"{1 + reserve['speculative_tokens']} tokens); capacity ratio with it: "
                      + (f"{reserve['capacity_ratio']:.3f}x" if reserve["capacity_ratio"] is not None else "-"),
                  "  KVPP's communicators run their first collectives before vLLM measures memory: vLLM counts "
                  "their buffers"]
    whole = report.get("vllm_whole_layer_steps")
    if whole is not None:
        lines += ["", f"in vLLM every step broadcasts whole layers, decode steps included: "
                      f"{format_bytes(whole['bytes_per_step'])} per step at full occupancy, "
                      f"{whole['seconds_per_step'] * 1e3:.1f} ms at {whole['link_gb_per_s']:g} GB/s: not for long "
                      "decodes at scale"]
        lines += [f"  {reason}" for reason in whole["reasons"]]
    if "draft_sharding_gain" in report:
        lines.append(f"draft sharding gain over local drafts: {report['draft_sharding_gain']:.3f}x")
    backends = report.get("vllm_backends")
    if backends:
        lines += ["", f"in vLLM, per MLA backend (compact slots need decode rows on their owners; at block size "
                      f"{report['block_size']}; the backend's own block size in brackets):"]
        for name, b in backends.items():
            if b["slots"] is None:
                lines.append(f"  {name:<15} [{b['vllm_block_size']:>3}] {'-':>11}       {'-':>7}   {b['why']}")
                continue
            lines.append(f"  {name:<15} [{b['vllm_block_size']:>3}] {b['slots']:>11} slots {b['capacity_ratio']:7.3f}x"
                         f"  {'owner rows: ' if b['owner_rows'] else 'no owner rows: '}{b['why']}")
        lines.append("  a block size the backend reads as smaller kernel blocks (vLLM's virtual block splitting) is "
                     "refused by KVPP: plan at the size in brackets")
        lines.append("  and only where no prefill row reads history: vLLM's CUDA defaults (chunked prefill, prefix "
                     "caching on) keep whole-layer slots; set enable_chunked_prefill=False, "
                     "enable_prefix_caching=False, and no speculative decoding, for compact ones")
    return "\n".join(lines)


def step_load(context_tokens: int, batch_tokens: int, requests: int, sparse_topk: int | None = None) -> StepLoad:
    """The step's query tokens and the (query, key) pairs its attention scores.

    `requests` requests share the `batch_tokens` query tokens and the `context_tokens` tokens of history
    as evenly as integers allow. A request's j-th query token scores its history and its own first j
    tokens; with sparse attention (SFA) at most `sparse_topk` of them.
    """
    for name, value, minimum in (("context_tokens", context_tokens, 0), ("batch_tokens", batch_tokens, 1),
                                 ("requests", requests, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    if sparse_topk is not None and (isinstance(sparse_topk, bool) or not isinstance(sparse_topk, int)
                                    or sparse_topk < 1):
        raise ValueError(f"sparse_topk must be None or an int >= 1, got {sparse_topk!r}.")
    if requests > batch_tokens:
        raise ValueError(f"{requests} requests cannot share {batch_tokens} query tokens: every request "
                         "of a step has at least one.")
    q_base, q_extra = divmod(batch_tokens, requests)
    c_base, c_extra = divmod(context_tokens, requests)
    both = min(q_extra, c_extra)
    groups = [(both, q_base + 1, c_base + 1),
              (q_extra - both, q_base + 1, c_base), (c_extra - both, q_base, c_base + 1),
              (requests - max(q_extra, c_extra), q_base, c_base)]
    pairs = sum(count * _request_pairs(q, c, sparse_topk) for count, q, c in groups)
    return StepLoad(query_tokens=batch_tokens, attention_pairs=pairs)


def _request_pairs(query_tokens: int, history: int, topk: int | None) -> int:
    """sum over j = 1..query_tokens of min(history + j, topk)."""
    full = query_tokens if topk is None else max(0, min(query_tokens, topk - history))
    return full * history + full * (full + 1) // 2 + (query_tokens - full) * (topk or 0)


def owner_cost(plan: KVPPPlan, transfer: dict[str, Any], shape: AttentionShape, link: LinkModel, *,
               batch_tokens: int, requests: int, sparse_topk: int | None = None) -> dict[str, Any]:
    """Owner-mode bytes and link time next to `transfer_cost`'s broadcasts, and the mode `choose_mode` picks.

    The broadcast side of the choice is what the runtime would send for this step: the active blocks, or
    whole layers where `transfer` took the whole-layer path. Every target layer has the same bundle, so
    one layer decides; per-forward figures are per-layer ones times the number of target layers.
    """
    load = step_load(transfer["context_tokens"], batch_tokens, requests, sparse_topk)
    layers = len(plan.target_layers)
    try:
        heads_per_rank = shape.split(plan.group_size)
    except ValueError as exc:
        raise ValueError(f"owner mode splits the heads over the KVPP group: {exc}") from None
    owner_per_layer = shape.owner_bytes_per_layer(load.query_tokens, plan.group_size)
    choice = choose_mode(shape, load, transfer["active_block"]["bytes_per_layer"], plan.group_size, link)
    if not transfer["fits_slot"]:  # wider than a compact slot: the rows go to their owners
        choice = dataclasses.replace(choice, mode=OWNER)
    extra_heads = shape.num_heads - heads_per_rank
    return {
        "group_size": plan.group_size, "batch_tokens": batch_tokens, "requests": requests,
        "attention_pairs": load.attention_pairs,
        "attention": {"num_heads": shape.num_heads, "heads_per_rank": heads_per_rank, "q_width": shape.q_width,
                      "out_width": shape.out_width, "itemsize": shape.itemsize, "sparse_topk": sparse_topk},
        "link_model": {"bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s,
                       "attention_flops_per_s": link.attention_flops_per_s},
        "owner_mode": {"bytes_per_layer": owner_per_layer, "bytes_per_forward": layers * owner_per_layer,
                       "seconds_per_layer": owner_per_layer / link.bytes_per_s,
                       "seconds_per_forward": layers * owner_per_layer / link.bytes_per_s},
        "mode_choice": {
            "mode": choice.mode, "broadcast_path": transfer["path"],
            "broadcast_bytes_per_layer": choice.broadcast_bytes, "owner_bytes_per_layer": choice.owner_bytes,
            "broadcast_seconds_per_layer": choice.broadcast_s, "owner_seconds_per_layer": choice.owner_s,
            "owner_compute_seconds_per_layer": (shape.attention_flops(load.attention_pairs, extra_heads)
                                                / link.attention_flops_per_s),
            "broadcast_seconds_per_forward": layers * choice.broadcast_s,
            "owner_seconds_per_forward": layers * choice.owner_s,
        },
    }


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _format_mode_choice(cost: dict[str, Any]) -> list[str]:
    att, link, choice = cost["attention"], cost["link_model"], cost["mode_choice"]
    group = cost["group_size"]
    sparse = f" (top-{att['sparse_topk']:,} sparse)" if att["sparse_topk"] else ""
    return [
        f"owner mode: {_plural(cost['batch_tokens'], 'query token')} of {_plural(cost['requests'], 'request')}, "
        f"{att['num_heads']} heads x ({att['q_width']} + {att['out_width']}) values x {att['itemsize']} B, "
        f"{group - 1}/{group} of them to and from the owner",
        f"mode for this step: {choice['mode']}   per layer: broadcast "
        f"{choice['broadcast_seconds_per_layer'] * 1e3:.3f} ms"
        f" ({choice['broadcast_path']}), owner {choice['owner_seconds_per_layer'] * 1e3:.3f} ms",
        f"  owner = 2 x {link['latency_s'] * 1e6:g} us latency + link + "
        f"{choice['owner_compute_seconds_per_layer'] * 1e3:.3f} ms attention for "
        f"{att['num_heads'] - att['heads_per_rank']} more heads over {cost['attention_pairs']:,} "
        f"query-key pairs{sparse} at {link['attention_flops_per_s'] / 1e12:g} TFLOP/s",
    ]
