"""Host cost of the runtime's protocol, with a no-op transport.

Two gloo ranks run the runtime exactly as a compiled graph calls it (the plan's schedule, its layers and
slots as constants), over a device API whose collectives complete at once and move nothing, so what is
timed is the runtime's own Python work: per layer (protocol checks, issuing and completing the work,
counters), for forwards with history (a broadcast per layer) and without (nothing to move). The
per-forward agreement is timed on its own in the same run, through a runtime with the real device API:
the runtime's `Agreement.agree` (fill its fixed tensor, the gloo all-reduce, compare) and the bare gloo
all-reduce of that tensor.

    python benchmarks/runtime_overhead.py [--layers 61] [--forwards 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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
    with_history, without, agreement, all_reduce = [], [], [], []
    probe = torch.zeros(8, dtype=torch.int64)  # the agreement's tensor: 4 values and their negations
    for _ in range(forwards):
        with_history.append(_forward(rt, True, calls) / layers * 1e6)
        without.append(_forward(rt, False, calls) / layers * 1e6)
        start = time.perf_counter()
        agreeing.agreement.agree(key)
        agreement.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
        all_reduce.append((time.perf_counter() - start) * 1e6)
    rt.close(), agreeing.close()
    return {"with_history_us": with_history, "without_history_us": without, "agreement_us": agreement,
            "all_reduce_us": all_reduce}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--forwards", type=int, default=400)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    res = run_ranks(worker, 2, args.layers, args.forwards, timeout_s=600)[0]
    result = {"layers": args.layers, "forwards": args.forwards,
              "us_per_layer_with_history": summary(res["with_history_us"]),
              "us_per_layer_without_history": summary(res["without_history_us"]),
              "us_agreement_per_forward": summary(res["agreement_us"]),
              "us_agreement_all_reduce": summary(res["all_reduce_us"]),
              "goal_us_per_layer_with_history": 5.0}
    med = statistics.median(res["with_history_us"])
    print(f"{args.layers} layers, {args.forwards} forwards, no-op transport: "
          f"{med:.1f} us/layer with history (prefetch+wait+broadcast issue/complete; goal <= 5), "
          f"{statistics.median(res['without_history_us']):.1f} us/layer without; agreement "
          f"{statistics.median(res['agreement_us']):.0f} us per forward through the runtime, of which the gloo "
          f"all-reduce alone {statistics.median(res['all_reduce_us']):.0f} us")
    write_result("runtime_overhead", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
