"""One step's transfer cost behind ``kvpp-fx plan --context-tokens``: whole-layer and active-block
broadcasts (`transfer_cost`), owner-mode bytes and the mode `kvpp_fx.cache.cost.choose_mode` picks
(`owner_cost`), and the step's query tokens and attention pairs (`step_load`). Each returns plain numbers
for the plan report."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvpp_fx.cache.cost import OWNER, AttentionShape, LinkModel, StepLoad, choose_mode, scored_pairs
from kvpp_fx.cache.placement import KVPPPlan


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
    pairs = sum(count * scored_pairs(q, c, sparse_topk) for count, q, c in groups)
    return StepLoad(query_tokens=batch_tokens, attention_pairs=pairs)


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
