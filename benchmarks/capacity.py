"""Blocks per rank with KVPP vs replicated at equal memory, measured by the real allocator.

For the reference `small` preset (8 layers) at TP 2 and TP 4, each rank's cache is really allocated
for the largest block count that fits the budget; the ratio is taken at the worst rank (the engine
uses one block count everywhere) and set next to the formula L / (ceil(L/N) + 2 + staging) and to
`kvpp-fx plan` for DeepSeek-V3 at TP 8. Each is measured with the active-block staging buffer (the
default, 25 % of the pool) and without it (staging_fraction=0, the seed's layout).

    python benchmarks/capacity.py [--kv-memory 1GiB]
"""

from __future__ import annotations

import argparse
import gc
import math
import sys

from _common import write_result

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.plan_report import build_plan, format_bytes, parse_bytes
from kvpp_fx.reference.config import PRESETS


def measured_blocks(plan: KVPPPlan, rank: int, budget: int) -> tuple[int, int]:
    blocks = plan.num_blocks(budget, rank)
    storage = allocate_cache(plan, rank, blocks)
    allocated = storage.allocated_bytes
    del storage
    gc.collect()
    if allocated > budget:
        raise AssertionError(f"rank {rank} allocated {allocated} > budget {budget}")
    return blocks, allocated


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    budget = parse_bytes(args.kv_memory)
    config = PRESETS["small"]
    spec = config.cache_spec(block_size=16)
    layers = config.num_hidden_layers
    rows = []
    replicated_blocks, replicated_bytes = measured_blocks(KVPPPlan(spec, group_size=1), 0, budget)
    for tp in (2, 4):
        row = {"preset": "small", "tp": tp, "replicated_blocks": replicated_blocks}
        for label, plan in (("", KVPPPlan(spec, group_size=tp)),
                            ("_without_staging", KVPPPlan(spec, group_size=tp, staging_fraction=0.0))):
            per_rank = [measured_blocks(plan, rank, budget) for rank in range(tp)]
            worst = min(b for b, _ in per_rank)
            row.update({f"kvpp_blocks_per_rank{label}": [b for b, _ in per_rank],
                        f"allocated_bytes_per_rank{label}": [a for _, a in per_rank],
                        f"measured_ratio{label}": worst / replicated_blocks,
                        f"formula_ratio{label}": plan.formula_capacity_ratio()})
        assert row["formula_ratio_without_staging"] == layers / (math.ceil(layers / tp) + 2)
        rows.append(row)
        print(f"small TP{tp}: replicated {replicated_blocks} blocks, KVPP {row['kvpp_blocks_per_rank']} blocks "
              f"-> {row['measured_ratio']:.3f}x (formula {row['formula_ratio']:.3f}x); without staging "
              f"{row['measured_ratio_without_staging']:.3f}x (formula {row['formula_ratio_without_staging']:.3f}x) "
              f"at {format_bytes(budget)} per rank")
    v3 = build_plan("deepseek-v3", tp=8, block_size=128)
    v3_budget = parse_bytes("64GiB")
    v3_ratio = v3.capacity_ratio(v3_budget)
    v3_without = v3.without_staging().capacity_ratio(v3_budget)
    v3_formula = 61 / (math.ceil(61 / 8) + 2)
    print(f"kvpp-fx plan deepseek-v3 TP8 (64 GiB, block 128): {v3_ratio:.3f}x with staging, {v3_without:.3f}x "
          f"without (formula {v3_formula:.3f}x)")
    write_result("capacity", {"kv_memory_bytes": budget, "replicated_allocated_bytes": replicated_bytes,
                              "reference": rows,
                              "deepseek_v3_tp8": {"plan_ratio": v3_ratio, "plan_ratio_without_staging": v3_without,
                                                  "formula_ratio": v3_formula, "kv_memory_bytes": v3_budget}},
                 args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
