"""``kvpp-fx demo``: the reference model on N CPU ranks, KVPP off then on, and a short report.

Launched in-process with torch's elastic launcher (``kvpp-fx demo --nproc 2``), or by torchrun:
``torchrun --nproc-per-node 2 -m kvpp_fx.demo``. Exits 1 if KVPP changed any token.

``--kvpp-mode`` picks how each step reaches the layers it does not own: ``broadcast`` (the blocks the
step reads travel to the ranks), ``owner`` (queries go to each layer's owner and outputs come back) or
``auto`` (the cheaper per step, by the cost model). ``--context-tokens N`` adds a request with an
N-token prompt, so that long-context decode steps appear next to the prefill chunks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

DEFAULTS = {"preset": "small", "mode": "piecewise", "inner": "eager", "kv_memory": "128MiB",
            "trace": "out/trace.json", "dump_dir": "out/graphs", "timeout_s": 60.0, "kvpp_mode": "auto",
            "context_tokens": 0}


def _run(engine_options: dict, *, kvpp: bool, preset: str, kv_memory: int, prompts, group, tp, timeline,
         dump_dir):
    import torch

    from kvpp_fx.reference.config import load_config
    from kvpp_fx.reference.engine import EngineConfig, build_engine
    from kvpp_fx.reference.workload import NEW_TOKENS

    torch._dynamo.reset()
    engine = build_engine(load_config(preset), engine_config=EngineConfig(**engine_options, dump_dir=dump_dir),
                          kv_memory=kv_memory, kvpp=kvpp, tp=tp, kvpp_group=group, timeline=timeline)
    for prompt in prompts:
        engine.add_request(prompt, NEW_TOKENS)
    outputs = engine.run()
    stats = engine.runtime.stats()
    engine.runtime.close()
    records = engine.backend.records if engine.backend is not None else []
    dump = records[-1].dump_dir if records else None
    steps = [{"tokens": s["num_tokens"], "decode_only": s["decode_only"], "mode": s["mode"],
              "active_blocks": s["active_blocks"], "pool_blocks": s["pool_blocks"],
              "broadcast_bytes": s["broadcast_bytes"], "owner_bytes": s["owner_bytes"]} for s in engine.steps]
    return {"outputs": outputs, "num_blocks": engine.runtime.storage.num_blocks, "stats": stats, "steps": steps,
            "decode_step_s": [s["seconds"] for s in engine.steps if s["decode_only"]], "kv_memory": kv_memory,
            "dump_dir": str(dump.parent.parent) if dump is not None else None}  # <dir>/rankN/graph_NNN


def demo_rank(options: dict) -> list[dict] | None:
    """One rank's work (torch.distributed env from the launcher). Rank 0 returns every rank's result."""
    import torch
    import torch.distributed as dist

    from kvpp_fx.plan_report import parse_bytes
    from kvpp_fx.reference.config import load_config
    from kvpp_fx.reference.model import TPInfo
    from kvpp_fx.reference.workload import TOKEN_BUDGET, shared_prefix_prompts
    from kvpp_fx.runtime.timeline import Timeline, write_chrome_trace
    from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

    torch.set_num_threads(1)
    timeout = timedelta(seconds=options["timeout_s"])
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world), timeout=timeout)
    tp = TPInfo(rank, world, dist.group.WORLD)
    vocab = load_config(options["preset"]).vocab_size
    prompts = shared_prefix_prompts(vocab)
    context = options.get("context_tokens", 0)
    if context:
        generator = torch.Generator().manual_seed(11)
        prompts.append(torch.randint(0, vocab, (context,), generator=generator).tolist())
    engine_options = {"graph_mode": options["mode"], "inner": options["inner"],
                      "token_budget": options.get("token_budget") or TOKEN_BUDGET,
                      "max_model_len": max(256, -(-(context + 64) // 256) * 256),
                      "kvpp_mode": options.get("kvpp_mode", "broadcast")}
    kv_memory = parse_bytes(options["kv_memory"])
    common = dict(preset=options["preset"], kv_memory=kv_memory, prompts=prompts, group=group, tp=tp)
    off = _run(engine_options, kvpp=False, timeline=None, dump_dir=None, **common)
    timeline = Timeline(rank) if options.get("trace") else None
    on = _run(engine_options, kvpp=True, timeline=timeline, dump_dir=options.get("dump_dir"), **common)
    mine = {"rank": rank, "off": off, "on": on, "trace_events": timeline.chrome_events() if timeline else []}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0 and options.get("trace"):
        write_chrome_trace(options["trace"], *[g.pop("trace_events") for g in gathered])
    dist.barrier()
    return gathered if rank == 0 else None


def build_report(results: list[dict], options: dict) -> dict[str, Any]:

    def median_ms(values):
        return 1e3 * statistics.median(values) if values else None

    r0 = results[0]
    identical = all(r["on"]["outputs"] == r["off"]["outputs"] for r in results)
    on_step, off_step = median_ms(r0["on"]["decode_step_s"]), median_ms(r0["off"]["decode_step_s"])
    worst_on_blocks = min(r["on"]["num_blocks"] for r in results)
    return {
        "preset": options["preset"], "ranks": len(results), "mode": options["mode"], "inner": options["inner"],
        "kv_memory_bytes": r0["on"]["kv_memory"], "kvpp_mode": options.get("kvpp_mode", "broadcast"),
        "tokens_identical": identical,
        "outputs": r0["on"]["outputs"],
        "per_rank": [{
            "rank": r["rank"], "owned_layers": r["on"]["stats"]["persistent_layers"],
            "cache_bytes_kvpp": r["on"]["stats"]["allocated_bytes"],
            "cache_bytes_replicated": r["off"]["stats"]["allocated_bytes"],
            "blocks_kvpp": r["on"]["num_blocks"], "blocks_replicated": r["off"]["num_blocks"],
            "broadcasts": r["on"]["stats"]["broadcasts"], "exchanges": r["on"]["stats"]["exchanges"],
            "bytes_moved": r["on"]["stats"]["bytes"], "modes": r["on"]["stats"]["modes"],
        } for r in results],
        "steps": r0["on"]["steps"],
        "capacity_ratio": worst_on_blocks / r0["off"]["num_blocks"],
        "decode_step_ms": {"kvpp": on_step, "replicated": off_step,
                           "ratio": on_step / off_step if on_step and off_step else None},
        "graph_dump": r0["on"]["dump_dir"],
        "trace": options.get("trace"),
    }


def format_report(report: dict[str, Any]) -> str:
    from kvpp_fx.plan_report import format_bytes, layer_ranges

    mark = "✓" if report["tokens_identical"] else "✗"
    lines = [f"kvpp-fx demo: {report['preset']} on {report['ranks']} CPU ranks (gloo), {report['mode']} mode "
             f"(inner {report['inner']}), {format_bytes(report['kv_memory_bytes'])} of KV memory per rank, "
             f"KVPP mode {report['kvpp_mode']}", ""]
    lines.append(f"{'rank':>4}  {'owned layers':<13} {'KVPP cache':>12} {'replicated':>12} {'blocks':>14} "
                 f"{'broadcasts':>10} {'exchanges':>9} {'bytes sent/recv':>16}")
    for r in report["per_rank"]:
        lines.append(f"{r['rank']:>4}  {layer_ranges(r['owned_layers']):<13} {format_bytes(r['cache_bytes_kvpp']):>12} "
                     f"{format_bytes(r['cache_bytes_replicated']):>12} "
                     f"{str(r['blocks_kvpp']) + ' vs ' + str(r['blocks_replicated']):>14} "
                     f"{r['broadcasts']:>10} {r['exchanges']:>9} {format_bytes(r['bytes_moved']):>16}")
    lines += ["", f"{'step':>4}  {'tokens':>6}  {'mode':<9}  {'blocks read (with history) / pool':>34}  "
                  f"{'bytes moved':>12}"]
    for i, st in enumerate(report["steps"]):
        read = "-" if st["mode"] == "owner" or (not st["broadcast_bytes"] and i == 0) else \
            f"{st['active_blocks']} / {st['pool_blocks']}"
        moved = st["broadcast_bytes"] + st["owner_bytes"]
        lines.append(f"{i:>4}  {st['tokens']:>6}  {st['mode']:<9}  {read:>34}  {format_bytes(moved):>12}")
    step = report["decode_step_ms"]
    lines += [
        "",
        f"capacity at equal memory: {report['capacity_ratio']:.2f}x the replicated blocks (worst rank)",
        f"tokens identical to the replicated run: {mark}",
        f"decode step (median): {step['kvpp']:.1f} ms with KVPP, {step['replicated']:.1f} ms replicated "
        f"({step['ratio']:.2f}x)" if step["ratio"] else "decode step: no decode-only steps",
        f"graph dump: {report['graph_dump']}",
        f"timeline:   {report['trace']}  (open in https://ui.perfetto.dev or chrome://tracing)",
    ]
    return "\n".join(lines)


def launch(nproc: int, options: dict) -> list[dict]:
    """Start `nproc` local ranks with torch's elastic launcher and return rank 0's gathered results."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from kvpp_fx.launch import free_port

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"kvpp-demo-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")
    results = elastic_launch(config, demo_rank)(options)
    return results[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpp_fx.cli import number_type

    non_negative = number_type(int, lambda v: v >= 0, "a non-negative integer")
    positive = number_type(int, lambda v: v >= 1, "a positive integer")
    parser.add_argument("--nproc", type=int, default=2, help="number of CPU ranks (the TP and KVPP group)")
    parser.add_argument("--preset", default=DEFAULTS["preset"], help="reference preset or HF model directory")
    parser.add_argument("--mode", choices=("eager", "piecewise"), default=DEFAULTS["mode"])
    parser.add_argument("--inner", default=DEFAULTS["inner"], help="inner backend of the piecewise mode")
    parser.add_argument("--kv-memory", default=DEFAULTS["kv_memory"], help="KV cache memory per rank")
    parser.add_argument("--trace", default=DEFAULTS["trace"], help="Chrome/Perfetto trace file ('' for none)")
    parser.add_argument("--dump-dir", default=DEFAULTS["dump_dir"], help="graph dump folder ('' for none)")
    parser.add_argument("--kvpp-mode", choices=("broadcast", "owner", "auto"), default=DEFAULTS["kvpp_mode"],
                        help="broadcast the blocks each step reads, send queries to each layer's owner, or pick "
                             "per step by the cost model (default)")
    parser.add_argument("--context-tokens", type=non_negative, default=DEFAULTS["context_tokens"],
                        help="add a request with a prompt of this many tokens (long-context decode)")
    parser.add_argument("--token-budget", type=positive, default=None, help="tokens per step (default 32)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_demo(args: argparse.Namespace) -> int:
    import warnings

    warnings.simplefilter("ignore")
    options = {"preset": args.preset, "mode": args.mode, "inner": args.inner, "kv_memory": args.kv_memory,
               "trace": args.trace or None, "dump_dir": args.dump_dir or None, "timeout_s": DEFAULTS["timeout_s"],
               "kvpp_mode": args.kvpp_mode, "context_tokens": args.context_tokens, "token_budget": args.token_budget}
    if options["trace"]:
        options["trace"] = str(Path(options["trace"]).resolve())
    if options["dump_dir"]:
        options["dump_dir"] = str(Path(options["dump_dir"]).resolve())
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:  # started by torchrun: we are one rank
        results = demo_rank(options)
        if results is None:
            return 0
    else:
        if args.nproc < 2:
            raise ValueError("--nproc must be at least 2: KVPP needs a group of two or more ranks.")
        results = launch(args.nproc, options)
    report = build_report(results, options)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["tokens_identical"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpp_fx.demo", description=__doc__)
    add_arguments(parser)
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
