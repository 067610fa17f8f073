"""Decode step time with KVPP / without, `small` preset at TP 2 on gloo, and bytes broadcast per step.

All runs use the same driver, graph mode and workload (two prompts sharing a 3-block prefix, 16
greedy tokens, repeated); they differ only in KVPP: off (replicated), on with active blocks (each
step broadcasts the blocks it reads), and on with whole layers (every step broadcasts every allocated
block). Bytes per decode step are also measured at 10 % and 100 % of the pool holding live tokens.

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
from kvpp_fx.cli.byte_sizes import format_bytes, parse_bytes
from kvpp_fx.reference.config import PRESETS
from kvpp_fx.reference.engine import EngineConfig, build_engine
from kvpp_fx.reference.model import TPInfo
from kvpp_fx.reference.workload import NEW_TOKENS, TOKEN_BUDGET, shared_prefix_prompts
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups


def make_engine(rank, world, kvpp, group, *, kv_memory=None, num_blocks=None, active_blocks=True):
    torch._dynamo.reset()
    engine_config = EngineConfig(graph_mode="piecewise", inner="eager", token_budget=TOKEN_BUDGET,
                                 active_blocks=active_blocks, compact_scratch=active_blocks)
    return build_engine(PRESETS["small"], engine_config=engine_config, num_blocks=num_blocks, kv_memory=kv_memory,
                        kvpp=kvpp, tp=TPInfo(rank, world, dist.group.WORLD), kvpp_group=group)


def decode_bytes(engine, since):
    return [s["broadcast_bytes"] for s in engine.steps[since:] if s["decode_only"]]


def step_times(rank, world, kvpp, kv_memory, repeats, group, active_blocks=True):
    engine = make_engine(rank, world, kvpp, group, kv_memory=kv_memory, active_blocks=active_blocks)
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
           "outputs": [r.output for r in engine.requests],
           "bytes_per_decode_step": statistics.median(decode_bytes(engine, timed_from) or [0])}
    engine.runtime.close()
    return out


def occupancy_bytes(rank, world, group, num_blocks):
    """Bytes per decode step with ~10 % and ~100 % of the pool's blocks holding live tokens.

    Requests of 13 blocks each (prompt + 24 new tokens), 2 of them (~10 %) or as many as fit (~100 %),
    each prefilled in one step so that all of them decode together; the step with the most live blocks
    is reported. On whole-layer slots: in a compact slot the ~100 % step does not fit, and its rows go to
    their owners instead of broadcasting.
    """
    torch._dynamo.reset()
    engine_config = EngineConfig(graph_mode="piecewise", inner="eager", token_budget=512, compact_scratch=False)
    engine = build_engine(PRESETS["small"], engine_config=engine_config, num_blocks=num_blocks, kvpp=True,
                          tp=TPInfo(rank, world, dist.group.WORLD), kvpp_group=group)
    block_size, per_request, new_tokens = engine.config.block_size, 13, 24
    out = {"allocated": engine.runtime.storage.allocated_bytes, "pool_blocks": num_blocks}
    for name, requests in (("10pct", max(1, round(0.1 * num_blocks / per_request))),
                           ("100pct", num_blocks // per_request)):
        since = len(engine.steps)
        prompt_len = per_request * block_size - new_tokens - 1
        for i in range(requests):
            engine.add_request([(7 * i + 3 * j + len(name)) % engine.cfg.vocab_size for j in range(prompt_len)],
                               new_tokens)
        engine.run()
        decode = [s for s in engine.steps[since:] if s["decode_only"]]
        busiest = max(decode, key=lambda s: s["active_blocks"])
        out[name] = {"requests": requests, "live_blocks": requests * per_request,
                     "blocks_read": busiest["active_blocks"], "bytes_per_decode_step": busiest["broadcast_bytes"]}
    engine.runtime.close()
    return out


def worker(rank, world, memories, repeats, occupancy_blocks):
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    results = {}
    for memory in memories:
        results[memory] = {"off": step_times(rank, world, False, memory, repeats, group),
                           "on": step_times(rank, world, True, memory, repeats, group),
                           "whole": step_times(rank, world, True, memory, repeats, group, active_blocks=False)}
    results["occupancy"] = occupancy_bytes(rank, world, group, occupancy_blocks)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-memory", nargs="+", default=["128MiB"])
    parser.add_argument("--occupancy-blocks", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    memories = [parse_bytes(m) for m in args.kv_memory]
    res = run_ranks(worker, 2, memories, args.repeats, args.occupancy_blocks, timeout_s=900)[0]
    rows = []
    for memory in memories:
        on, off, whole = res[memory]["on"], res[memory]["off"], res[memory]["whole"]
        assert on["outputs"] == off["outputs"] == whole["outputs"], "KVPP changed the tokens"
        s_on, s_off, s_whole = summary(on["decode_s"]), summary(off["decode_s"]), summary(whole["decode_s"])
        ratio = s_on["median"] / s_off["median"]
        ratio_whole = s_whole["median"] / s_off["median"]
        rows.append({"kv_memory_bytes": memory, "blocks_kvpp": on["blocks"], "blocks_replicated": off["blocks"],
                     "allocated_kvpp": on["allocated"], "allocated_replicated": off["allocated"],
                     "decode_step_s": {"kvpp": s_on, "replicated": s_off, "kvpp_whole_layer": s_whole},
                     "bytes_per_decode_step": {"kvpp": on["bytes_per_decode_step"],
                                               "kvpp_whole_layer": whole["bytes_per_decode_step"]},
                     "ratio_of_medians": ratio, "ratio_of_medians_whole_layer": ratio_whole})
        print(f"{format_bytes(memory)} per rank ({on['blocks']} vs {off['blocks']} blocks): decode step "
              f"replicated {s_off['median']*1e3:.1f} ms [{s_off['min']*1e3:.1f}-{s_off['max']*1e3:.1f}], "
              f"KVPP active blocks {s_on['median']*1e3:.1f} ms [{s_on['min']*1e3:.1f}-{s_on['max']*1e3:.1f}] "
              f"-> {ratio:.2f}x (goal <= 1.25), KVPP whole layers {s_whole['median']*1e3:.1f} ms -> "
              f"{ratio_whole:.2f}x; bytes per decode step {format_bytes(on['bytes_per_decode_step'])} vs "
              f"{format_bytes(whole['bytes_per_decode_step'])}")
    occ = res["occupancy"]
    occupancy = {}
    for name in ("10pct", "100pct"):
        sent = occ[name]["bytes_per_decode_step"]
        occupancy[name] = {**occ[name], "allocated": occ["allocated"],
                           "broadcast_over_allocated": sent / occ["allocated"]}
        print(f"occupancy {name:>6} ({occ[name]['live_blocks']}/{args.occupancy_blocks} blocks live, "
              f"{occ[name]['blocks_read']} read by the busiest decode step): "
              f"{format_bytes(sent)} broadcast per decode step, {sent / occ['allocated']:.2f}x this rank's "
              f"allocated cache ({format_bytes(occ['allocated'])})")
    ten_over_full = occupancy["10pct"]["bytes_per_decode_step"] / occupancy["100pct"]["bytes_per_decode_step"]
    print(f"bytes per decode step at 10 % over 100 % occupancy: {ten_over_full:.3f} (goal <= 0.2, ideal ~0.1)")
    write_result("decode_step", {"preset": "small", "tp": 2, "repeats": args.repeats, "rows": rows,
                                 "occupancy": occupancy, "occupancy_blocks": args.occupancy_blocks,
                                 "bytes_10pct_over_100pct": ten_over_full, "goal_ratio": 1.25,
                                 "goal_bytes_10pct_over_100pct": 0.2}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
