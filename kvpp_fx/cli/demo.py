"""``kvpp-fx demo``: the reference model on N CPU ranks, KVPP off then on, and a short report.

Launched in-process with torch's elastic launcher (``kvpp-fx demo --nproc 2``), or by torchrun:
``torchrun --nproc-per-node 2 -m kvpp_fx.cli.demo``. Exits 1 if KVPP changed any token.

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
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from kvpp_fx.cli.argtypes import non_negative_int, positive_int
from kvpp_fx.cache.cost import KVPP_MODES, Mode

GRAPH_MODES = ("eager", "piecewise")  # the backend's; the demo always compiles


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs. Its defaults are the command's (`add_arguments` reads them); the launcher
    pickles it to every rank."""

    nproc: int = 2                        # CPU ranks started by the elastic launcher (ignored under torchrun)
    preset: str = "small"                 # reference preset or HF model directory
    mode: str = "piecewise"               # the backend's graph mode
    inner: str = "eager"                  # inner backend of the piecewise mode
    kv_memory: str = "128MiB"             # KV cache memory per rank
    trace: str | None = "out/trace.json"  # Chrome/Perfetto trace file (None: none)
    dump_dir: str | None = "out/graphs"   # graph dump folder (None: none)
    kvpp_mode: str = "auto"               # "broadcast", "owner" or "auto" (per step, by the cost model)
    context_tokens: int = 0               # > 0: one more request with a prompt of this many tokens
    token_budget: int | None = None       # tokens per step (None: the workload's TOKEN_BUDGET)
    timeout_s: float = 60.0               # of the process groups

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoOptions:
        """The parsed command line, with '' for no trace or dump and paths made absolute (every rank
        writes to the same place, wherever it runs)."""
        return cls(nproc=args.nproc, preset=args.preset, mode=args.mode, inner=args.inner, kv_memory=args.kv_memory,
                   trace=_absolute(args.trace), dump_dir=_absolute(args.dump_dir), kvpp_mode=args.kvpp_mode,
                   context_tokens=args.context_tokens, token_budget=args.token_budget)


def _absolute(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


def demo_rank(options: DemoOptions) -> list[dict] | None:
    """One rank's work (torch.distributed env from the launcher): the workload with KVPP off, then on.
    Rank 0 returns every rank's result."""
    import torch
    import torch.distributed as dist

    from kvpp_fx.cli.byte_sizes import parse_bytes
    from kvpp_fx.reference.config import load_config
    from kvpp_fx.reference.engine import EngineConfig
    from kvpp_fx.reference.generate import rank_groups, run_engine
    from kvpp_fx.reference.workload import NEW_TOKENS, TOKEN_BUDGET, shared_prefix_prompts
    from kvpp_fx.runtime.timeline import Timeline, write_chrome_trace

    torch.set_num_threads(1)
    timeout = timedelta(seconds=options.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = rank_groups(rank, world, timeout=timeout)
    config = load_config(options.preset)
    prompts = shared_prefix_prompts(config.vocab_size)
    context = options.context_tokens
    if context:
        generator = torch.Generator().manual_seed(11)
        prompts.append(torch.randint(0, config.vocab_size, (context,), generator=generator).tolist())
    engine_config = EngineConfig(graph_mode=options.mode, inner=options.inner,
                                 token_budget=options.token_budget or TOKEN_BUDGET,
                                 max_model_len=max(256, -(-(context + 64) // 256) * 256), kvpp_mode=options.kvpp_mode)
    kv_memory = parse_bytes(options.kv_memory)
    timeline = Timeline(rank) if options.trace else None
    mine: dict[str, Any] = {"rank": rank}
    for kvpp in (False, True):
        torch._dynamo.reset()
        result = run_engine(config, prompts, NEW_TOKENS, groups=groups, kvpp=kvpp, kv_memory=kv_memory,
                            engine_config=replace(engine_config, dump_dir=options.dump_dir if kvpp else None),
                            timeline=timeline if kvpp else None)
        mine["on" if kvpp else "off"] = _run_summary(result, kv_memory)
    mine["trace_events"] = timeline.chrome_events() if timeline else []
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0 and options.trace:
        write_chrome_trace(options.trace, *[g.pop("trace_events") for g in gathered])
    dist.barrier()
    return gathered if rank == 0 else None


def _run_summary(result: dict[str, Any], kv_memory: int) -> dict[str, Any]:
    """What the report reads of one run (`run_engine`'s result)."""
    steps = [{"tokens": s["num_tokens"], "decode_only": s["decode_only"], "mode": s["mode"],
              "active_blocks": s["active_blocks"], "pool_blocks": s["pool_blocks"],
              "broadcast_bytes": s["broadcast_bytes"], "owner_bytes": s["owner_bytes"]} for s in result["steps"]]
    dumps = result["dump_dirs"]
    return {"outputs": result["outputs"], "num_blocks": result["num_blocks"], "stats": result["stats"], "steps": steps,
            "decode_step_s": [s["seconds"] for s in result["steps"] if s["decode_only"]], "kv_memory": kv_memory,
            "dump_dir": str(Path(dumps[-1]).parent.parent) if dumps else None}  # <dir>/rankN/graph_NNN


def build_report(results: list[dict], options: DemoOptions) -> dict[str, Any]:

    def median_ms(values):
        return 1e3 * statistics.median(values) if values else None

    r0 = results[0]
    identical = all(r["on"]["outputs"] == r["off"]["outputs"] for r in results)
    on_step, off_step = median_ms(r0["on"]["decode_step_s"]), median_ms(r0["off"]["decode_step_s"])
    worst_on_blocks = min(r["on"]["num_blocks"] for r in results)
    return {
        "preset": options.preset, "ranks": len(results), "mode": options.mode, "inner": options.inner,
        "kv_memory_bytes": r0["on"]["kv_memory"], "kvpp_mode": options.kvpp_mode,
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
        "trace": options.trace,
    }


def format_report(report: dict[str, Any]) -> str:
    from kvpp_fx.cli.byte_sizes import format_bytes
    from kvpp_fx.cli.plan_report import layer_ranges

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
        read = "-" if st["mode"] == Mode.OWNER or (not st["broadcast_bytes"] and i == 0) else \
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


def launch(nproc: int, options: DemoOptions) -> list[dict]:
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
    defaults = DemoOptions()
    parser.add_argument("--nproc", type=int, default=defaults.nproc, help="number of CPU ranks (the TP and KVPP group)")
    parser.add_argument("--preset", default=defaults.preset, help="reference preset or HF model directory")
    parser.add_argument("--mode", choices=GRAPH_MODES, default=defaults.mode)
    parser.add_argument("--inner", default=defaults.inner, help="inner backend of the piecewise mode")
    parser.add_argument("--kv-memory", default=defaults.kv_memory, help="KV cache memory per rank")
    parser.add_argument("--trace", default=defaults.trace, help="Chrome/Perfetto trace file ('' for none)")
    parser.add_argument("--dump-dir", default=defaults.dump_dir, help="graph dump folder ('' for none)")
    parser.add_argument("--kvpp-mode", choices=KVPP_MODES, default=defaults.kvpp_mode,
                        help="broadcast the blocks each step reads, send queries to each layer's owner, or pick "
                             f"per step by the cost model (default {defaults.kvpp_mode})")
    parser.add_argument("--context-tokens", type=non_negative_int, default=defaults.context_tokens,
                        help="add a request with a prompt of this many tokens (long-context decode)")
    parser.add_argument("--token-budget", type=positive_int, default=defaults.token_budget,
                        help="tokens per step (default 32, the workload's budget)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_demo(args: argparse.Namespace) -> int:
    import warnings

    warnings.simplefilter("ignore")
    options = DemoOptions.from_args(args)
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:  # started by torchrun: we are one rank
        results = demo_rank(options)
        if results is None:
            return 0
    else:
        if options.nproc < 2:
            raise ValueError("--nproc must be at least 2: KVPP needs a group of two or more ranks.")
        results = launch(options.nproc, options)
    report = build_report(results, options)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["tokens_identical"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpp_fx.cli.demo", description=__doc__)
    add_arguments(parser)
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
