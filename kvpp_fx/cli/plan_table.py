"""The text table ``kvpp-fx plan`` prints: `format_plan_table` renders the plan report (`plan_report`'s dict,
with the step cost and the vLLM rows the command adds to it) line by line; ``--json`` prints the dict
itself."""

from __future__ import annotations

from typing import Any

from kvpp_fx.cli.byte_sizes import format_bytes
from kvpp_fx.cli.plan_report import layer_ranges


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
                      f"decodes at scale; whole-layer slots there ({whole['engine_blocks']:,} blocks, "
                      f"{whole['capacity_ratio']:.3f}x)"]
        lines += [f"  {reason}" for reason in whole["reasons"]]
        only = whole.get("owner_only")
        if only is not None:
            lines += [f"with {only['needs']}: owner-only slots ({only['slot_blocks']} block), "
                      f"{only['engine_blocks']:,} blocks, {only['capacity_ratio']:.3f}x; every row on its layers' "
                      f"owners, whose link carries {format_bytes(only['owner_bytes_per_layer_and_token'])} per layer "
                      "and decode token whatever the context"]
    if "draft_sharding_gain" in report:
        lines.append(f"draft sharding gain over local drafts: {report['draft_sharding_gain']:.3f}x")
    backends = report.get("vllm_backends")
    if backends:
        lines += ["", f"in vLLM with its defaults (chunked prefill and prefix caching on"
                      f"{', MTP' if report['draft_layers'] else ''}), per MLA backend (compact slots need "
                      f"decode rows on their owners; at block size {report['block_size']}; the backend's own block "
                      "size in brackets):"]
        for name, b in backends.items():
            if b["slots"] is None:
                lines.append(f"  {name:<15} [{b['vllm_block_size']:>3}] {'-':>11}       {'-':>7}   {b['why']}")
                continue
            lines.append(f"  {name:<15} [{b['vllm_block_size']:>3}] {b['slots']:>11} slots {b['capacity_ratio']:7.3f}x"
                         f"  {'owner rows: ' if b['owner_rows'] else 'no owner rows: '}{b['why']}")
        lines.append("  a block size the backend reads as smaller kernel blocks (vLLM's virtual block splitting) is "
                     "refused by KVPP: plan at the size in brackets")
        lines.append("  a prefill row's history (later chunks, prefix-cache hits, verification rows run as prefill) "
                     "streams from each layer's owner into vLLM's context workspace: it needs no slot")
    return "\n".join(lines)


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
