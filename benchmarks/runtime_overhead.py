"""Host cost of the runtime's protocol, with a no-op transport.

Two gloo ranks run the runtime exactly as a compiled graph calls it (the plan's schedule, its layers and
slots as constants), over a device API whose collectives complete at once and move nothing, so what is
timed is the runtime's own Python work: per layer (protocol checks, issuing and completing the work,
counters), for forwards with history (a broadcast per layer) and without (nothing to move). The
per-forward agreement is timed on its own in the same run, through a runtime with the real device API:
the runtime's `Agreement.agree` (fill its fixed tensor, the gloo all-reduce, compare) and the bare gloo
all-reduce of that tensor.

The agreement is also timed where a device checks it, at the forward's end: the host's wait there
(its all-reduce ran while the forward's host work did). ``--baseline DIR`` measures another checkout's
runtime (a git worktree on this venv) in the same run, alternating, and reports the ratio.

    python benchmarks/runtime_overhead.py [--layers 61] [--forwards 400] [--baseline ../base]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _common import summary, write_result
from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.launch import run_ranks
from kvpp_fx.runtime.agreement import AgreementKey, ForwardPath
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

HERE = Path(__file__).parent


class _DoneWork:
    def wait(self, timeout=None) -> bool:
        return True


class NoOpTransportAPI(DeviceAPI):
    """The real stream and event calls (a device's; on CPU they do nothing, and the runtime skips them);
    collectives that complete immediately and move nothing."""

    def broadcast(self, tensor, src, group):
        return _DoneWork()

    def all_reduce_max(self, tensor, group):
        return _DoneWork()


def _calls(rt: KVPPRuntime) -> list:
    """The ops of one forward as a compiled graph calls them: bound once, layers and slots as constants."""
    return [(getattr(rt, step.kind), step.layer, step.slot) for step in rt.plan.schedule().steps()]


def _forward(rt: KVPPRuntime, has_history: bool, calls: list | None = None) -> float:
    calls = _calls(rt) if calls is None else calls
    start = time.perf_counter()
    with rt.forward(has_history):
        for op, layer, slot in calls:
            op(layer, slot)
    return time.perf_counter() - start


class DeviceChecks(DeviceAPI):
    """The CPU's collectives with a device's order of checks: the agreement is checked when the forward
    ends, not before its first collective."""

    immediate_checks = False


def worker(rank, world, layers, forwards):
    comps = (ComponentSpec("kv", "bfloat16", (576,)),)
    spec = ModelCacheSpec("bench", 16, tuple(LayerCacheSpec(i, comps) for i in range(layers)))
    plan = KVPPPlan(spec, group_size=world)
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    storage = allocate_cache(plan, dist.get_rank(group), 4)
    rt = KVPPRuntime.create(plan, storage, group, device_api=NoOpTransportAPI("cpu"))
    agreeing = KVPPRuntime.create(plan, storage, group)  # the real all-reduce, for the agreement alone
    key = AgreementKey(ForwardPath.WHOLE_LAYERS)
    calls = _calls(rt)
    for _ in range(50):
        _forward(rt, True, calls)
    with_history, without, agreement, all_reduce, at_end = [], [], [], [], []
    late = None
    if hasattr(agreeing.parts.agreement, "issue"):  # the agreement checked at the forward's end (a device's order)
        late = KVPPRuntime.create(plan, storage, group, device_api=DeviceChecks("cpu"),
                                  agreement_group=create_kvpp_process_groups(kvpp_groups(world, tp=world),
                                                                             backend="gloo"))
        late_calls = _calls(late)
    probe = torch.zeros(8, dtype=torch.int64)  # the agreement's tensor: 4 values and their negations
    for _ in range(forwards):
        with_history.append(_forward(rt, True, calls) / layers * 1e6)
        without.append(_forward(rt, False, calls) / layers * 1e6)
        start = time.perf_counter()
        agreeing.parts.agreement.agree(key)
        agreement.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
        all_reduce.append((time.perf_counter() - start) * 1e6)
        if late is not None:
            _forward(late, False, late_calls)
            at_end.append(late.parts.agreement.last_wait_s * 1e6)
    rt.close(), agreeing.close()
    return {"with_history_us": with_history, "without_history_us": without, "agreement_us": agreement,
            "all_reduce_us": all_reduce, "agreement_wait_at_end_us": at_end}


def measure(layers: int, forwards: int, baseline: str | None, rounds: int) -> tuple[dict, dict | None]:
    """This checkout's runtime and, with `baseline`, that checkout's, alternating round by round on this host."""
    mine, theirs = {}, {} if baseline else None
    for _ in range(rounds):
        for key, values in run_ranks(worker, 2, layers, forwards // rounds, timeout_s=600)[0].items():
            mine.setdefault(key, []).extend(values)
        if baseline:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                env = {**os.environ, "PYTHONPATH": os.path.abspath(baseline)}
                subprocess.run([sys.executable, __file__, "--layers", str(layers),
                                "--forwards", str(forwards // rounds), "--raw", out.name],
                               env=env, check=True, cwd=HERE)
                for key, values in json.loads(Path(out.name).read_text()).items():
                    theirs.setdefault(key, []).extend(values)
    return mine, theirs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--forwards", type=int, default=400)
    parser.add_argument("--baseline", default=None,
                        help="a checkout of another revision on this venv (a git worktree): measured in the same run")
    parser.add_argument("--rounds", type=int, default=4, help="alternations with the baseline")
    parser.add_argument("--goal-ratio", type=float, default=1.0,
                        help="the most this checkout may cost per layer against the baseline (a refactor: 1.0)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--raw", default=None, help=argparse.SUPPRESS)  # one measurement, as JSON, for a baseline run
    args = parser.parse_args(argv)
    if args.raw:
        Path(args.raw).write_text(json.dumps(run_ranks(worker, 2, args.layers, args.forwards, timeout_s=600)[0]))
        return 0
    res, base = measure(args.layers, args.forwards, args.baseline, args.rounds if args.baseline else 1)
    result = {"layers": args.layers, "forwards": args.forwards,
              "us_per_layer_with_history": summary(res["with_history_us"]),
              "us_per_layer_without_history": summary(res["without_history_us"]),
              "us_agreement_per_forward": summary(res["agreement_us"]),
              "us_agreement_all_reduce": summary(res["all_reduce_us"]),
              "us_agreement_wait_at_forward_end": summary(res["agreement_wait_at_end_us"]),
              "goal_us_per_layer_with_history": 5.0}
    med = statistics.median(res["with_history_us"])
    print(f"{args.layers} layers, {args.forwards} forwards, no-op transport: "
          f"{med:.1f} us/layer with history (prefetch+wait+broadcast issue/complete; goal <= 5), "
          f"{statistics.median(res['without_history_us']):.1f} us/layer without; agreement "
          f"{statistics.median(res['agreement_us']):.0f} us per forward through the runtime, of which the gloo "
          f"all-reduce alone {statistics.median(res['all_reduce_us']):.0f} us; checked at the forward's end (a "
          f"device's order), the host waited {statistics.median(res['agreement_wait_at_end_us']):.0f} us there")
    if base is not None:
        result["baseline"] = {"revision": _revision(args.baseline),
                              "us_per_layer_with_history": summary(base["with_history_us"]),
                              "us_per_layer_without_history": summary(base["without_history_us"])}
        for kind in ("with_history", "without_history"):
            result[f"ratio_{kind}"] = statistics.median(res[f"{kind}_us"]) / statistics.median(base[f"{kind}_us"])
        result["goal_ratio"] = args.goal_ratio
        print(f"against {result['baseline']['revision']}, same run: {result['ratio_with_history']:.2f}x with history, "
              f"{result['ratio_without_history']:.2f}x without (goal <= {args.goal_ratio:g})")
    write_result("runtime_overhead", result, args.out)
    return 0


def _revision(checkout: str) -> str:
    try:
        return subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.path.abspath(checkout)


if __name__ == "__main__":
    sys.exit(main())
