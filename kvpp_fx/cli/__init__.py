"""``kvpp-fx``: the command-line entry points (plan, graph, demo).

The package is the command line: `main` and its parser live here, the commands' helpers beside it
(`plan_report`, `step_cost`, `plan_table`, `byte_sizes`, `demo`, `argtypes`). Importing it stays cheap (no
torch): each command imports what it needs when it runs."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvpp_fx.cli.argtypes import non_negative_float, non_negative_int, positive_float, positive_int
from kvpp_fx.cache.placement import DEFAULT_DEPTH, MIN_DEPTH
from kvpp_fx.cache.spec import KV_DTYPES, QUERY_DTYPES, UnknownModelError

DEFAULT_MAX_NUM_SEQS = 1024  # vLLM's default on H100/H200-class GPUs


class UsageError(Exception):
    """A bad option: reported on one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump, no traceback
        raise UsageError(message)


def _depth(text: str) -> int:
    value = positive_int(text)
    if value < MIN_DEPTH:
        raise argparse.ArgumentTypeError(
            f"scratch depth must be at least {MIN_DEPTH}, got {value}: with one slot the next layer's "
            "broadcast overwrites the slot the current layer reads")
    return value


# Owner-mode cost defaults of `kvpp-fx plan`: an H200-class device (the runtime's LinkModel defaults
# describe gloo on one CPU host instead).
PLAN_LINK_LATENCY_US = 20.0
PLAN_ATTENTION_TFLOPS = 400.0
_STEP_OPTIONS = ("batch_tokens", "requests", "link_latency_us", "attention_tflops", "query_dtype")


# Options of the single-cache plan that a model with several caches per layer (DeepSeek-V4) has no use for.
_SINGLE_CACHE_OPTIONS = ("block_size", "depth", "shard_draft", "max_batched_tokens", "scratch_blocks", "max_num_seqs",
                         "context_tokens", *_STEP_OPTIONS)


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvpp_fx.cache.spec import LAYER_CACHES_MODEL_TYPES, load_hf_config

    name, config = load_hf_config(args.model)
    if config.get("model_type") in LAYER_CACHES_MODEL_TYPES:
        return _cmd_plan_layer_caches(args, name, config)
    for option, default in (("block_size", 128), ("kv_dtype", "bf16"), ("depth", DEFAULT_DEPTH),
                            ("max_num_seqs", DEFAULT_MAX_NUM_SEQS)):
        if getattr(args, option) is None:
            setattr(args, option, default)
    return _cmd_plan_single_cache(args)


def _cmd_plan_layer_caches(args: argparse.Namespace, name: str, config: dict) -> int:
    from kvpp_fx.cache.layer_caches import (DEEPSEEK_V4_KV_DTYPES, LayerCachesPlan, deepseek_v4_caches,
                                            layer_caches_report)
    from kvpp_fx.cli.byte_sizes import parse_bytes
    from kvpp_fx.cli.layer_caches_table import format_layer_caches_table

    given = [f"--{option.replace('_', '-')}" for option in _SINGLE_CACHE_OPTIONS
             if getattr(args, option) not in (None, False)] + (["--pcp"] if args.pcp != 1 else [])
    if given:
        raise UsageError(f"{', '.join(given)}: not used for {config['model_type']}, whose every row runs on its "
                         "layer's owner (no scratch slots) in pages of vLLM's own block sizes; drop it")
    if args.kv_dtype not in (None, *DEEPSEEK_V4_KV_DTYPES):
        raise UsageError(f"--kv-dtype {args.kv_dtype}: {config['model_type']}'s KV cache is one of "
                         f"{', '.join(DEEPSEEK_V4_KV_DTYPES)} (fp8: vLLM's fp8_ds_mla, the default)")
    model = deepseek_v4_caches(config, name=name, kv_dtype=args.kv_dtype or "fp8", include_mtp=args.mtp)
    plan = LayerCachesPlan(model, args.tp)
    contexts = tuple(sorted({131072, 1048576, *([args.max_model_len] if args.max_model_len else [])}))
    report = layer_caches_report(plan, parse_bytes(args.kv_memory), contexts)
    print(json.dumps(report, indent=2) if args.json else format_layer_caches_table(report))
    return 0


def _cmd_plan_single_cache(args: argparse.Namespace) -> int:
    from kvpp_fx.cache.cost import LinkModel
    from kvpp_fx.cache.spec import attention_shape_from_hf_config, load_hf_config
    from kvpp_fx.cli.byte_sizes import parse_bytes
    from kvpp_fx.cli.plan_report import (DEFAULT_TOKEN_BUDGET, build_plan, exchange_reserve, plan_report,
                                         vllm_whole_layer_steps)
    from kvpp_fx.cli.plan_table import format_plan_table
    from kvpp_fx.cli.step_cost import owner_cost, transfer_cost

    if args.context_tokens is None:
        given = [f"--{name.replace('_', '-')}" for name in _STEP_OPTIONS if getattr(args, name) is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: only used with --context-tokens (the step they describe)")
    batch_tokens = 1 if args.batch_tokens is None else args.batch_tokens
    requests = batch_tokens if args.requests is None else args.requests
    if requests > batch_tokens:
        raise UsageError(f"--requests {requests} exceeds --batch-tokens {batch_tokens}: every request of a step "
                         "has at least one query token")
    available = parse_bytes(args.kv_memory)
    if args.max_batched_tokens is not None and args.max_model_len is None:
        raise UsageError("--max-batched-tokens: only used with --max-model-len (together they bound the "
                         "scratch slots)")
    token_budget = args.max_batched_tokens
    if args.max_model_len is not None and token_budget is None:
        token_budget = DEFAULT_TOKEN_BUDGET
    plan = build_plan(args.model, tp=args.tp, pcp=args.pcp, block_size=args.block_size,
                      kv_dtype=args.kv_dtype, mtp=args.mtp, shard_draft=args.shard_draft, depth=args.depth,
                      max_model_len=args.max_model_len, token_budget=token_budget,
                      scratch_blocks=args.scratch_blocks)
    report = plan_report(plan, available, max_model_len=args.max_model_len, token_budget=token_budget)
    _, config = load_hf_config(args.model)
    whole = vllm_whole_layer_steps(plan, available, sparse=bool(config.get("index_topk")),
                                   pcp=args.pcp, link_gb_per_s=args.link_gbps,
                                   owner_shape=_owner_shape(config, plan.group_size))
    if whole is not None:
        report["vllm_whole_layer_steps"] = whole
        # the per-backend rows describe dense MLA decode rows on their owners, which this engine has not
        report.pop("vllm_backends", None)
        report.pop("vllm_config", None)
    elif (shape := _owner_shape(config, plan.group_size)) is not None:  # decode rows go to their owners
        report["exchange_reserve"] = exchange_reserve(
            plan, shape, available, max_num_seqs=args.max_num_seqs,
            speculative_tokens=int(config.get("num_nextn_predict_layers") or 0) if args.mtp else 0,
            token_budget=token_budget or DEFAULT_TOKEN_BUDGET)
    if args.context_tokens is not None:
        shape = attention_shape_from_hf_config(config, args.query_dtype or "bf16")
        link = LinkModel(bytes_per_s=args.link_gbps * 1e9,
                         latency_s=(PLAN_LINK_LATENCY_US if args.link_latency_us is None
                                    else args.link_latency_us) / 1e6,
                         attention_flops_per_s=(PLAN_ATTENTION_TFLOPS if args.attention_tflops is None
                                                else args.attention_tflops) * 1e12)
        cost = transfer_cost(plan, report["engine_blocks"], args.context_tokens, args.link_gbps)
        if args.pcp > 1:  # PCP ranks hold different tokens of the same heads: there are no heads to gather
            cost["owner_mode_unavailable"] = "owner mode splits heads over the KVPP group, which needs PCP = 1"
        else:
            cost.update(owner_cost(plan, cost, shape, link, batch_tokens=batch_tokens, requests=requests,
                                   sparse_topk=config.get("index_topk") or None))
        report["transfer_cost"] = cost
    print(json.dumps(report, indent=2) if args.json else format_plan_table(report))
    return 0


def _owner_shape(config, group_size: int):
    """The model's owner-mode attention shape, or None where owner mode cannot run it (heads unknown, or
    not split evenly over the group)."""
    from kvpp_fx.cache.spec import attention_shape_from_hf_config  # as `_cmd_plan`: the CLI imports lazily

    try:
        shape = attention_shape_from_hf_config(config, "bf16")
        shape.split(group_size)
    except ValueError:
        return None
    return shape


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
    plan.add_argument("--tp", type=positive_int, required=True)
    plan.add_argument("--pcp", type=positive_int, default=1)
    plan.add_argument("--kv-memory", default="40GiB", help="KV cache memory per rank, e.g. 40GiB")
    plan.add_argument("--block-size", type=positive_int, default=None, help="tokens per block (default 128)")
    plan.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                      help="default bf16; fp8 (vLLM's fp8_ds_mla) for DeepSeek-V4")
    plan.add_argument("--depth", type=_depth, default=None,
                      help=f"scratch buffers per rank (at least {MIN_DEPTH}, default {DEFAULT_DEPTH})")
    plan.add_argument("--mtp", action="store_true", help="include the config's nextn layers as drafts")
    plan.add_argument("--shard-draft", action="store_true", help="give draft layers owners too")
    plan.add_argument("--max-model-len", type=positive_int, default=None,
                      help="the longest request in tokens: scratch slots then hold what one step can read "
                           "(compact scratch) instead of whole layers; for DeepSeek-V4, one more context to print "
                           "(besides 128K and 1M)")
    plan.add_argument("--max-batched-tokens", type=positive_int, default=None,
                      help="the token budget of one step, with --max-model-len (default 8192)")
    plan.add_argument("--max-num-seqs", type=positive_int, default=None,
                      help="requests one step may hold: bounds the decode rows owner mode exchanges, whose peak "
                           f"a GPU engine keeps out of the KV budget (default {DEFAULT_MAX_NUM_SEQS}, vLLM's on "
                           "H100/H200-class GPUs)")
    plan.add_argument("--scratch-blocks", type=positive_int, default=None,
                      help="blocks per scratch slot, overriding what --max-model-len gives")
    plan.add_argument("--context-tokens", type=non_negative_int, default=None,
                      help="total tokens of history one step reads: prints broadcast and owner-mode bytes and "
                           "link time per layer and forward, and the mode the cost model picks")
    plan.add_argument("--batch-tokens", type=positive_int, default=None,
                      help="query tokens of that step (default 1: one decoding request)")
    plan.add_argument("--requests", type=positive_int, default=None,
                      help="requests the query tokens belong to, sharing the context evenly (default: "
                           "--batch-tokens, a decode step; 1 for one request's prefill chunk)")
    plan.add_argument("--link-gbps", type=positive_float, default=400.0,
                      help="link bandwidth in GB/s (gigabytes) for --context-tokens (default 400)")
    plan.add_argument("--link-latency-us", type=non_negative_float, default=None,
                      help=f"fixed cost of one collective in microseconds (default {PLAN_LINK_LATENCY_US:g})")
    plan.add_argument("--attention-tflops", type=positive_float, default=None,
                      help="attention throughput of a layer's owner in TFLOP/s, for the heads it computes for "
                           f"the other ranks in owner mode (default {PLAN_ATTENTION_TFLOPS:g})")
    plan.add_argument("--query-dtype", choices=tuple(QUERY_DTYPES), default=None,
                      help="dtype of the queries and outputs owner mode ships (default bf16; the KV dtype "
                           "does not change it)")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_cmd_plan)

    graph = sub.add_parser("graph", help="print the reference model's graph after the KVPP pass")
    graph.add_argument("--model", default="tiny", help="reference preset or HF model directory")
    graph.add_argument("--mode", choices=("eager", "piecewise"), default="eager")
    graph.add_argument("--layers", type=positive_int, default=2, help="number of decoder layers")
    graph.add_argument("--dump-dir", default=None, help="also write the dump files here")
    graph.set_defaults(func=_cmd_graph)

    from kvpp_fx.cli.demo import add_arguments, run_demo

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

