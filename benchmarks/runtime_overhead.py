"""Host cost of the runtime's protocol, with a no-op transport.

Two gloo ranks run the runtime exactly as a compiled graph calls it, over a device API whose
collectives complete at once and move nothing, so what is timed is the runtime's own Python work:
per layer (protocol checks, event record/wait, issuing and completing the work, counters), for
forwards with history (a broadcast per layer) and without (nothing to move). Each forward also starts
with one real agreement all-reduce of 6 int64 values on the KVPP group; its gloo latency is timed on
its own in the same run.

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
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups


class _DoneWork:
    def wait(self, timeout=None) -> bool:
        return True


class NoOpTransportAPI(DeviceAPI):
    """The real stream/event calls; broadcasts that complete immediately and move nothing."""

    def broadcast(self, tensor, src, group):
        return _DoneWork()

    def all_reduce_max(self, tensor, group):
        return _DoneWork()


def _forward(rt: KVPPRuntime, has_history: bool) -> float:
    plan = rt.plan
    layers = plan.target_layers
    start = time.perf_counter()
    with rt.forward(has_history):
        rt.prefetch(layers[0], plan.slot(layers[0]))
        for layer in layers:
            rt.wait(layer, plan.slot(layer))
            nxt = plan.next_target(layer)
            if nxt is not None:
                rt.prefetch(nxt, plan.slot(nxt))
    return time.perf_counter() - start


def worker(rank, world, layers, forwards):
    comps = (ComponentSpec("kv", "bfloat16", (576,)),)
    spec = ModelCacheSpec("bench", 16, tuple(LayerCacheSpec(i, comps) for i in range(layers)))
    plan = KVPPPlan(spec, group_size=world)
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    rt = KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), 4), group,
                            device_api=NoOpTransportAPI("cpu"))
    for _ in range(50):
        _forward(rt, True)
    with_history, without, agreement = [], [], []
    probe = torch.zeros(6, dtype=torch.int64)
    for _ in range(forwards):
        with_history.append(_forward(rt, True) / layers * 1e6)
        without.append(_forward(rt, False) / layers * 1e6)
        start = time.perf_counter()
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
        agreement.append((time.perf_counter() - start) * 1e6)
    rt.close()
    return {"with_history_us": with_history, "without_history_us": without, "agreement_us": agreement}


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
              "us_agreement_per_forward": summary(res["agreement_us"])}
    med = statistics.median(res["with_history_us"])
    print(f"{args.layers} layers, {args.forwards} forwards, no-op transport: "
          f"{med:.1f} us/layer with history (prefetch+wait+broadcast issue/complete), "
          f"{statistics.median(res['without_history_us']):.1f} us/layer without; agreement all-reduce "
          f"{statistics.median(res['agreement_us']):.0f} us per forward (gloo)")
    write_result("runtime_overhead", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
