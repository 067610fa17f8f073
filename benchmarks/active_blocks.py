"""Active-block broadcast against whole-layer broadcast, by the fraction of the pool a step reads.

Two gloo ranks, a layer bundle shaped like the `small` preset's (fp32 latent cache, 16-token blocks)
in a pool of `--blocks` blocks. For each fraction f, rank 0 owns the layer and one forward with
history moves it to rank 1 either whole (`blocks=None`) or as the f * pool blocks a step reads
(gather into staging, one broadcast, scatter). Both are timed in the same run, interleaved; the
crossover is the smallest fraction where the active-block path is no faster than the whole layer.

    python benchmarks/active_blocks.py [--blocks 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch.distributed as dist

from _common import write_result

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.launch import run_ranks
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _forward(rt: KVPPRuntime, blocks) -> float:
    dist.barrier()
    start = time.perf_counter()
    with rt.forward(has_history=True, blocks=blocks):
        rt.plan.schedule().run(rt)
    return time.perf_counter() - start


def worker(rank, world, num_blocks, width, repeats):
    comps = (ComponentSpec("kv", "float32", (width,)),)
    spec = ModelCacheSpec("bench", 16, tuple(LayerCacheSpec(i, comps) for i in range(2)))
    plan = KVPPPlan(spec, group_size=world, staging_fraction=1.0)  # room for every fraction
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    rt = KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), num_blocks), group, crossover=1.0)
    for _ in range(3):
        _forward(rt, None)
    rows = []
    for fraction in FRACTIONS:
        count = max(1, round(fraction * num_blocks))
        blocks = list(range(0, num_blocks, num_blocks // count))[:count]  # spread over the pool
        whole, active = [], []
        for _ in range(repeats):
            whole.append(_forward(rt, None))
            active.append(_forward(rt, blocks))
        rows.append({"fraction": fraction, "blocks": count, "whole_s": statistics.median(whole),
                     "active_s": statistics.median(active), "whole_raw_s": whole, "active_raw_s": active})
    rt.close()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--width", type=int, default=144, help="fp32 values per token (small: 128 + 16)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = run_ranks(worker, 2, args.blocks, args.width, args.repeats, timeout_s=600)[1]  # the receiver's view
    crossover = next((r["fraction"] for r in rows if r["active_s"] >= r["whole_s"]), None)
    layer_bytes = args.blocks * 16 * args.width * 4
    for r in rows:
        r["active_over_whole"] = r["active_s"] / r["whole_s"]
        print(f"f={r['fraction']:.2f} ({r['blocks']:>4} blocks): whole {r['whole_s']*1e3:7.2f} ms  "
              f"active {r['active_s']*1e3:7.2f} ms  -> {r['active_over_whole']:.2f}x")
    print(f"two layers of {layer_bytes / 2**20:.1f} MiB each; crossover fraction: "
          f"{crossover if crossover is not None else '> 1.0 (active never slower)'}")
    write_result("active_blocks", {"ranks": 2, "pool_blocks": args.blocks, "layer_bytes": layer_bytes,
                                   "repeats": args.repeats, "rows": rows, "crossover_fraction": crossover}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
