"""``kvpp-fx``: the command-line entry points (plan, graph, demo)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvpp_fx.cache.placement import DEFAULT_DEPTH, DEFAULT_STAGING_FRACTION, MIN_DEPTH
from kvpp_fx.cache.spec import KV_DTYPES, UnknownModelError


class UsageError(Exception):
    """A bad option: reported on one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump, no traceback
        raise UsageError(message)


def _number(kind: type, ok, wanted: str):
    """An argparse type: `kind(text)` that satisfies `ok`, else a one-line error naming `wanted`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_non_negative_int = _number(int, lambda v: v >= 0, "a non-negative integer")
_positive_float = _number(float, lambda v: 0 < v < float("inf"), "a positive number")
_fraction = _number(float, lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]")


def _depth(text: str) -> int:
    value = _positive_int(text)
    if value < MIN_DEPTH:
        raise argparse.ArgumentTypeError(
            f"scratch depth must be at least {MIN_DEPTH}, got {value}: with one slot the next layer's "
            "broadcast overwrites the slot the current layer reads")
    return value


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvpp_fx.plan_report import build_plan, format_plan_table, parse_bytes, plan_report, transfer_cost

    available = parse_bytes(args.kv_memory)
    plan = build_plan(args.model, tp=args.tp, pcp=args.pcp, block_size=args.block_size,
                      kv_dtype=args.kv_dtype, mtp=args.mtp, shard_draft=args.shard_draft, depth=args.depth,
                      staging_fraction=args.staging_fraction)
    report = plan_report(plan, available)
    if args.context_tokens is not None:
        report["transfer_cost"] = transfer_cost(plan, report["engine_blocks"], args.context_tokens, args.link_gbps)
    print(json.dumps(report, indent=2) if args.json else format_plan_table(report))
    return 0


def _cmd_graph(args: argparse.Namespace) -> int:
    from kvpp_fx.reference.graphs import compile_reference, graph_text

    with _quiet_torch():
        result = compile_reference(args.model, layers=args.layers, mode=args.mode, dump_dir=args.dump_dir)
    print(graph_text(result, args.mode))
    return 0


def _quiet_torch():
    import contextlib
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvpp-fx", description="KV layer parallelism for MLA/SFA models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="capacity planner: owners, blocks and ratio per rank")
    plan.add_argument("--model", required=True, help="preset name or path to a HF config.json")
    plan.add_argument("--tp", type=_positive_int, required=True)
    plan.add_argument("--pcp", type=_positive_int, default=1)
    plan.add_argument("--kv-memory", default="40GiB", help="KV cache memory per rank, e.g. 40GiB")
    plan.add_argument("--block-size", type=_positive_int, default=128)
    plan.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    plan.add_argument("--depth", type=_depth, default=DEFAULT_DEPTH,
                      help=f"scratch buffers per rank (at least {MIN_DEPTH})")
    plan.add_argument("--mtp", action="store_true", help="include the config's nextn layers as drafts")
    plan.add_argument("--shard-draft", action="store_true", help="give draft layers owners too")
    plan.add_argument("--staging-fraction", type=_fraction, default=DEFAULT_STAGING_FRACTION,
                      help="active-block staging as a fraction of the pool (0 disables active blocks)")
    plan.add_argument("--context-tokens", type=_non_negative_int, default=None,
                      help="total tokens one step reads: prints bytes and link time per layer and forward")
    plan.add_argument("--link-gbps", type=_positive_float, default=400.0,
                      help="link bandwidth in GB/s (gigabytes) for --context-tokens (default 400)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_cmd_plan)

    graph = sub.add_parser("graph", help="print the reference model's graph after the KVPP pass")
    graph.add_argument("--model", default="tiny", help="reference preset or HF model directory")
    graph.add_argument("--mode", choices=("eager", "piecewise"), default="eager")
    graph.add_argument("--layers", type=_positive_int, default=2, help="number of decoder layers")
    graph.add_argument("--dump-dir", default=None, help="also write the dump files here")
    graph.set_defaults(func=_cmd_graph)

    from kvpp_fx.demo import add_arguments, run_demo

    demo = sub.add_parser("demo", help="run the reference model on N CPU ranks with KVPP off and on")
    add_arguments(demo)
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (UsageError, UnknownModelError, ValueError) as exc:
        print(f"kvpp-fx: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
