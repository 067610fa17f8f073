"""Decode step time with KVPP / without, `small` preset at TP 2 on gloo, and bytes broadcast per step.

Both runs use the same driver, graph mode and workload (two prompts sharing a 3-block prefix, 16
greedy tokens, repeated); the only difference is the KVPP toggle. Every decode step with KVPP
broadcasts each target layer's whole bundle, so its cost grows with the allocated cache, not with the
tokens in use: the step is measured at two allocations, and the bytes per decode step are set next to
the allocated cache at 10 % and 100 % occupancy.

    python benchmarks/decode_step.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist

from _common import summary, write_result

from kvpp_fx.launch import run_ranks
from kvpp_fx.plan_report import format_bytes, parse_bytes
from kvpp_fx.reference.config import PRESETS
from kvpp_fx.reference.engine import EngineConfig, build_engine
from kvpp_fx.reference.model import TPInfo
from kvpp_fx.reference.workload import NEW_TOKENS, TOKEN_BUDGET, shared_prefix_prompts
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups


def make_engine(rank, world, kvpp, group, *, kv_memory=None, num_blocks=None):
    torch._dynamo.reset()
    engine_config = EngineConfig(graph_mode="piecewise", inner="eager", token_budget=TOKEN_BUDGET)
    return build_engine(PRESETS["small"], engine_config=engine_config, num_blocks=num_blocks, kv_memory=kv_memory,
                        kvpp=kvpp, tp=TPInfo(rank, world, dist.group.WORLD), kvpp_group=group)


def decode_bytes(engine, since):
    return [s["broadcast_bytes"] for s in engine.steps[since:] if s["decode_only"]]


def step_times(rank, world, kvpp, kv_memory, repeats, group):
    engine = make_engine(rank, world, kvpp, group, kv_memory=kv_memory)
    vocab = engine.cfg.vocab_size
    timed_from = 0
    for round_ in range(repeats + 1):  # round 0 compiles; fresh prompts keep every round's shapes alike
        if round_ == 1:
            timed_from = len(engine.steps)
        for prompt in shared_prefix_prompts(vocab, seed=100 + round_):
            engine.add_request(prompt, NEW_TOKENS)
        engine.run()
    out = {"decode_s": [s["seconds"] for s in engine.steps[timed_from:] if s["decode_only"]],
           "blocks": engine.runtime.storage.num_blocks, "allocated": engine.runtime.storage.allocated_bytes,
           "outputs": [r.output for r in engine.requests]}
    engine.runtime.close()
    return out


def occupancy_bytes(rank, world, group, num_blocks):
    """Bytes per decode step with ~10 % and ~100 % of the blocks holding live tokens."""
    engine = make_engine(rank, world, True, group, num_blocks=num_blocks)
    block_size = engine.config.block_size
    out = {"allocated": engine.runtime.storage.allocated_bytes}
    for name, fraction in (("10pct", 0.10), ("100pct", 1.0)):
        blocks_each = max(1, int(fraction * num_blocks / 6))  # six requests, each its own blocks
        prompt_len = blocks_each * block_size - 5  # the 4 decode tokens still fit in those blocks
        since = len(engine.steps)
        requests = [engine.add_request([(7 * i + 3 * j + len(name)) % engine.cfg.vocab_size
                                        for j in range(prompt_len)], 4) for i in range(6)]
        engine.run()
        live = sum(-(-(len(r.prompt) + 4) // block_size) for r in requests)
        out[name] = {"live_blocks": live, "bytes_per_decode_step": statistics.median(decode_bytes(engine, since))}
    engine.runtime.close()
    return out


def worker(rank, world, memories, repeats, occupancy_blocks):
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    results = {}
    for memory in memories:
        results[memory] = {"off": step_times(rank, world, False, memory, repeats, group),
                           "on": step_times(rank, world, True, memory, repeats, group)}
    results["occupancy"] = occupancy_bytes(rank, world, group, occupancy_blocks)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-memory", nargs="+", default=["24MiB", "128MiB"])
    parser.add_argument("--occupancy-blocks", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    memories = [parse_bytes(m) for m in args.kv_memory]
    res = run_ranks(worker, 2, memories, args.repeats, args.occupancy_blocks, timeout_s=900)[0]
    rows = []
    for memory in memories:
        on, off = res[memory]["on"], res[memory]["off"]
        assert on["outputs"] == off["outputs"], "KVPP changed the tokens"
        s_on, s_off = summary(on["decode_s"]), summary(off["decode_s"])
        ratio = s_on["median"] / s_off["median"]
        rows.append({"kv_memory_bytes": memory, "blocks_kvpp": on["blocks"], "blocks_replicated": off["blocks"],
                     "allocated_kvpp": on["allocated"], "allocated_replicated": off["allocated"],
                     "decode_step_s": {"kvpp": s_on, "replicated": s_off}, "ratio_of_medians": ratio})
        print(f"{format_bytes(memory)} per rank ({on['blocks']} vs {off['blocks']} blocks): decode step KVPP "
              f"{s_on['median']*1e3:.1f} ms [{s_on['min']*1e3:.1f}-{s_on['max']*1e3:.1f}] vs replicated "
              f"{s_off['median']*1e3:.1f} ms [{s_off['min']*1e3:.1f}-{s_off['max']*1e3:.1f}] -> {ratio:.2f}x "
              f"(target <= 1.10)")
    occ = res["occupancy"]
    occupancy = {}
    for name in ("10pct", "100pct"):
        sent = occ[name]["bytes_per_decode_step"]
        occupancy[name] = {**occ[name], "allocated": occ["allocated"], "broadcast_over_allocated": sent / occ["allocated"]}
        print(f"occupancy {name:>6} ({occ[name]['live_blocks']}/{args.occupancy_blocks} blocks live): "
              f"{format_bytes(sent)} broadcast per decode step, {sent / occ['allocated']:.2f}x this rank's "
              f"allocated cache ({format_bytes(occ['allocated'])})")
    write_result("decode_step", {"preset": "small", "tp": 2, "repeats": args.repeats, "rows": rows,
                                 "occupancy": occupancy, "occupancy_blocks": args.occupancy_blocks,
                                 "target_ratio": 1.10}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
