"""Packed active blocks against whole-layer broadcast, and against the staged path they replaced, by the
fraction of the pool a step reads (a prefill chunk over its history reads a growing fraction).

Two gloo ranks, a layer bundle shaped like the `small` preset's (fp32 latent cache, 16-token blocks)
in a pool of `--blocks` blocks. For each fraction f, one forward with history moves the two layers (one
owned by each rank) either whole (`blocks=None`) or as the f * pool blocks a step reads, packed (the
owner gathers them into its own slot, one broadcast, nothing scattered). The staged path the packed one
replaced (a gather into a staging buffer, one broadcast, a scatter from staging into the slot) is timed
by the same forward plus that scatter on the receiver (`StagedScatter`, a device API that copies what
arrived to the blocks' ids in a buffer of its own). All three are timed in the same run, interleaved;
the crossover is the smallest fraction where the packed path is no faster than the whole layer.

    python benchmarks/active_blocks.py [--blocks 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _common import write_result

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.launch import run_ranks
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _forward(rt: KVPPRuntime, blocks) -> float:
    dist.barrier()
    start = time.perf_counter()
    with rt.forward(has_history=True, blocks=blocks):
        rt.plan.schedule().run(rt)
    return time.perf_counter() - start


class StagedScatter(DeviceAPI):
    """After each packed broadcast a receiver gets, the staged path's scatter: the blocks that arrived
    copied to their ids in a layer-sized buffer (its own, so the runtime's bytes are untouched)."""

    def __init__(self, device, layer_blocks: int, block_bytes: int) -> None:
        super().__init__(device)
        self.block_bytes = block_bytes
        self.layer = torch.empty(layer_blocks, block_bytes, dtype=torch.uint8)
        self.ids: torch.Tensor | None = None
        self._received: dict[int, torch.Tensor] = {}

    def broadcast(self, tensor, src, group):
        work = super().broadcast(tensor, src, group)
        if src != dist.get_rank() and self.ids is not None:
            self._received[id(work)] = tensor
        return work

    def wait_work(self, work, timeout) -> None:
        super().wait_work(work, timeout)
        tensor = self._received.pop(id(work), None)
        if tensor is not None:
            count = self.ids.numel()
            blocks = tensor[count * 8:].view(count, self.block_bytes)  # after the ids
            self.layer.index_copy_(0, self.ids, blocks)


def worker(rank, world, num_blocks, width, repeats):
    comps = (ComponentSpec("kv", "float32", (width,)),)
    spec = ModelCacheSpec("bench", 16, tuple(LayerCacheSpec(i, comps) for i in range(2)))
    plan = KVPPPlan(spec, group_size=world)
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    storage = allocate_cache(plan, dist.get_rank(group), num_blocks)
    rt = KVPPRuntime.create(plan, storage, group, crossover=1.0)
    staged_api = StagedScatter("cpu", num_blocks, plan.bundle_bytes_per_block(0))
    staged = KVPPRuntime.create(plan, storage, group, crossover=1.0, device_api=staged_api)
    for _ in range(3):
        _forward(rt, None)
    rows = []
    for fraction in FRACTIONS:
        count = max(1, round(fraction * num_blocks))
        blocks = list(range(0, num_blocks, num_blocks // count))[:count]  # spread over the pool
        staged_api.ids = torch.tensor(sorted(blocks), dtype=torch.int64)
        whole, active, staged_s, nbytes = [], [], [], 0
        for _ in range(repeats):
            whole.append(_forward(rt, None))
            active.append(_forward(rt, blocks))
            nbytes = rt.last_forward()["bytes"]
            staged_s.append(_forward(staged, blocks))
        rows.append({"fraction": fraction, "blocks": count, "whole_s": statistics.median(whole),
                     "active_s": statistics.median(active), "staged_s": statistics.median(staged_s),
                     "active_bytes": nbytes, "whole_raw_s": whole, "active_raw_s": active, "staged_raw_s": staged_s})
    rt.close()
    staged.close()
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
        r["active_over_staged"] = r["active_s"] / r["staged_s"]
        print(f"f={r['fraction']:.2f} ({r['blocks']:>4} blocks, {r['active_bytes'] / 2**20:6.2f} MiB): whole "
              f"{r['whole_s']*1e3:7.2f} ms  packed {r['active_s']*1e3:7.2f} ms  staged {r['staged_s']*1e3:7.2f} ms"
              f"  -> {r['active_over_whole']:.2f}x whole, {r['active_over_staged']:.2f}x staged")
    print(f"two layers of {layer_bytes / 2**20:.1f} MiB each; crossover fraction: "
          f"{crossover if crossover is not None else '> 1.0 (active never slower)'}")
    write_result("active_blocks", {"ranks": 2, "pool_blocks": args.blocks, "layer_bytes": layer_bytes,
                                   "repeats": args.repeats, "rows": rows, "crossover_fraction": crossover}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
