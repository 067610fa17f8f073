"""The host time KVPP adds to a vLLM step, and its host-device synchronisations, as contexts grow.

Two gloo ranks drive `kvpp_fx.integrations.vllm.engine.step.step_forward` as vLLM's V1 runner does (a
`StepBatch` from host block-table rows, vLLM's MLA metadata in its forward context), for decode-only
steps of R requests with H history blocks each (block 64, every block distinct), in owner, auto and
broadcast mode. The cache, the metadata's tensors and the runtime's device values live on the ``meta``
device with a no-op transport (`tests.support.host_sync`), so what is timed is the host's own work:
from the scheduler's output (the batch's rows) through the forward's opening (the requests, the path,
the packed list, the agreement, the remapped metadata) to the first layer's prefetch, plus the
forward's end. Layers' turns run but are not timed (`runtime_overhead.py`). ``syncs_per_step`` counts
host reads of device values (`HostSyncDetector`, counting instead of raising). The per-forward
agreement's gloo all-reduce is issued at the opening and checked at the end (a device's path); the
host's wait for it there is ``agreement_wait_ms``, apart from ``host_ms``: here the layers take no time,
on a device their work runs while it is in flight.

The pool has four times the step's blocks, so broadcast mode packs the blocks (under the crossover)
rather than sending whole layers: the expensive broadcast path.

    python benchmarks/step_host_cost.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import write_result  # noqa: E402
from kvpp_fx.cache.allocate import allocate_cache  # noqa: E402
from kvpp_fx.cache.cost import AttentionShape  # noqa: E402
from kvpp_fx.cache.placement import KVPPPlan  # noqa: E402
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec  # noqa: E402
from kvpp_fx.integrations.vllm.attention.owner_rows import DEFAULT_LINKS  # noqa: E402
from kvpp_fx.launch import run_ranks  # noqa: E402
from kvpp_fx.runtime.runtime import KVPPRuntime  # noqa: E402
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups  # noqa: E402
from tests.support.host_sync import HostSyncDetector, MetaDeviceAPI, VllmStep  # noqa: E402

BLOCK = 64
CASES = ((64, 500), (256, 500), (256, 2000))
MODES = ("owner", "auto", "broadcast")
DEEPSEEK = AttentionShape(num_heads=128, q_width=576, out_width=512, itemsize=2)  # DeepSeek-V3, bf16


def worker(rank, world, repeats):
    groups = kvpp_groups(world, tp=world)
    timeout = timedelta(seconds=120)
    group = create_kvpp_process_groups(groups, timeout=timeout)
    host_group = create_kvpp_process_groups(groups, timeout=timeout, backend="gloo")
    exchange_group = create_kvpp_process_groups(groups, timeout=timeout)
    comps = (ComponentSpec("kv", "bfloat16", (576,)),)
    spec = ModelCacheSpec("deepseek-like", BLOCK, tuple(LayerCacheSpec(i, comps) for i in range(4)))
    plan = KVPPPlan(spec, group_size=world)
    out = {}
    for requests, history in CASES:
        rows = np.arange(requests * (history + 1), dtype=np.int64).reshape(requests, history + 1)
        computed = [history * BLOCK - 3] * requests  # the last history block is partly filled
        storage = allocate_cache(plan, rank, 4 * rows.size, device="meta")
        case = {}
        for mode in MODES:
            api = MetaDeviceAPI()
            runtime = KVPPRuntime.create(plan, storage, group, device_api=api, timeout=timeout,
                                         agreement_group=host_group, exchange_group=exchange_group,
                                         attention=DEEPSEEK, link=DEFAULT_LINKS["cuda"])
            runtime.note_routing(plan.target_layers, True)
            step = VllmStep(runtime, mode)

            def batch():
                return step.batch(computed, [1] * requests, rows, BLOCK)

            step.run(batch, requests)  # warm-up
            detector = HostSyncDetector(strict=False)
            with detector:
                step.run(batch, requests)
            times, waits, path = [], [], None
            for _ in range(repeats):
                result = step.run(batch, requests)
                times.append(result["host_ms"])
                waits.append(result["agreement_wait_ms"])
                path = result["mode"]
            case[mode] = {"host_ms": statistics.median(times), "min_ms": min(times), "path": path,
                          "syncs_per_step": len(detector.reads), "agreement_wait_ms": statistics.median(waits)}
            runtime.close()
        out[f"{requests}x{history}"] = case
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cases = run_ranks(worker, 2, args.repeats, timeout_s=1200)[0]
    owner = [cases[f"256x{h}"]["owner"]["host_ms"] for h in (500, 2000)]
    goals = {"owner_ms_at_256_requests": 1.0, "owner_256x2000_over_256x500": 1.25,
             "auto_and_broadcast_ms_at_256x2000": 25.0, "syncs_per_step": 0}
    met = {"owner_ms_at_256_requests": max(owner) <= 1.0,
           "owner_256x2000_over_256x500": owner[1] <= 1.25 * owner[0],
           "auto_and_broadcast_ms_at_256x2000": all(cases["256x2000"][m]["host_ms"] <= 25.0
                                                    for m in ("auto", "broadcast")),
           "syncs_per_step": all(c[m]["syncs_per_step"] == 0 for c in cases.values() for m in MODES)}
    for name, case in cases.items():
        print(name, "  ".join(f"{m}: {case[m]['host_ms']:.2f} ms ({case[m]['path']}, {case[m]['syncs_per_step']} syncs)"
                              for m in MODES))
    print("goals met:", met)
    write_result("step_host_cost", {"block_size": BLOCK, "repeats": args.repeats, "cases": cases, "goals": goals,
                                    "met": met}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
