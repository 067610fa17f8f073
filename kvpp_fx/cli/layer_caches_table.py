"""The text ``kvpp-fx plan`` prints for a model whose layers hold several caches (DeepSeek-V4):
`format_layer_caches_table` renders `kvpp_fx.cache.layer_caches.layer_caches_report`'s dict; ``--json``
prints the dict itself."""

from __future__ import annotations

from typing import Any

from kvpp_fx.cli.byte_sizes import format_bytes
from kvpp_fx.cli.plan_report import layer_ranges


def _tokens(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def format_layer_caches_table(report: dict[str, Any]) -> str:
    ratios = report["compress_ratios"]
    kinds = {kind: [i for i in report["target_layers"] if ratios[i] == kind] for kind in (0, 4, 128)}
    groups = ", ".join(f"{g['caches']} x {g['block_size']}-token pages = {g['page_bytes']:,} B"
                       for g in report["groups"])
    lines = [
        f"KVPP plan: {report['model']}  group={report['group_size']}  kv_dtype={report['kv_dtype']}"
        f"  kv_memory={format_bytes(report['kv_memory_bytes'])}",
        f"target layers: {len(report['target_layers'])} (window-only {len(kinds[0])}, ratio 4 {len(kinds[4])}, "
        f"ratio 128 {len(kinds[128])})  draft layers: {layer_ranges(report['draft_layers'])}"
        + (" (local on every rank)" if report["draft_layers"] else ""),
        f"vLLM's KV cache groups, packed in blocks of {report['packed_block_bytes']:,} B: {groups}",
        report["path"],
        "",
        f"{'rank':>4}  {'owned layers':<34} {'block B':>9} {'blocks':>9} {'B/token':>9} {'bounded B/request':>18}",
    ]
    for r in report["ranks"]:
        owned = f"{layer_ranges(r['owned_layers'])} ({len(r['owned_layers'])})"
        lines.append(f"{r['rank']:>4}  {owned:<34} {r['block_bytes']:>9,} {r['blocks']:>9,} "
                     f"{r['bytes_per_token']:>9,.2f} {r['bounded_bytes']:>18,}")
    lines += [
        f"{'repl':>4}  {'all':<34} {report['packed_block_bytes']:>9,} {report['replicated_blocks']:>9,} "
        f"{report['replicated_bytes_per_token']:>9,.2f} {report['replicated_bounded_bytes']:>18,}",
        "",
        f"capacity ratio (worst rank {report['worst_rank']}): {report['capacity_ratio']:.3f}x vLLM's blocks at every "
        f"context; {report['ideal_ratio']:.3f}x per context token",
    ]
    for at in report["contexts"]:
        lines += [
            "",
            f"one request of {_tokens(at['context_tokens'])} tokens: {at['blocks_per_request']:,} blocks; requests per "
            f"rank {at['replicated_requests']:,} -> {at['kvpp_requests']:,}",
            f"  {'cache':<26} {'layers':>6} {'page B':>8} {'block':>6} {'B/token/layer':>14} {'replicated':>12} "
            f"{'worst rank':>12}",
        ]
        for name, row in at["caches"].items():
            per_token = f"{row['bytes_per_token_per_layer']:,.2f}" if row["grows"] else "bounded"
            lines.append(f"  {name:<26} {row['layers']:>6} {row['page_bytes']:>8,} {row['block_size']:>6} "
                         f"{per_token:>14} {format_bytes(row['replicated_bytes']):>12} "
                         f"{format_bytes(row['worst_rank_bytes']):>12}")
        lines.append(f"  a decode token reads {format_bytes(at['decode_read_bytes'])} of cache (what a broadcast of "
                     f"the step's reads moves); owner mode moves "
                     f"{format_bytes(report['owner_exchange_bytes_per_layer'])} per layer and non-owner rank")
    return "\n".join(lines)
