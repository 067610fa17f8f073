"""Streamed prefill history hidden behind compute: a prefix-cache hit's history, chunk by chunk from each
layer's owner, with the next chunk in flight (`ContextRows` with a chunk plan) against one at a time.

Two gloo ranks own 4 of 8 layers each. A prefill row with a 16K-token history reads it as vLLM's MLA
prefill does: in 2K-token chunks landing in one workspace (576 bfloat16 values a token, 2.25 MiB a
chunk), each followed by the chunk's attention, here a compute stand-in that releases the CPU (a sleep,
as a device kernel lets the host wait; `overlap_model.py` does the same), sized to 1.2x one chunk's
broadcast as the serial forward times it. The forward runs three ways:

- prefetched: the next chunk, and the next layer's first, issued while the current one computes, the
  workspace and the prefetch buffer taking turns;
- serial: the same calls with ``overlap=False``, each chunk completing inside the call that issues it
  (`overlap_model.py`'s baseline: the same work, nothing moving behind compute);
- without a plan: each chunk gathered and broadcast when its own call comes (what a caller without a chunk
  plan gets).

Transfer time is the sum of the serial run's chunk spans, each from its broadcast's issue to its completion.
Each repeat runs the three forwards with one compute stand-in, 1.2x a chunk's transfer in the repeat before
(a probe's for the first), so that the stand-in follows the host's pace; the figures are the medians of the
repeats':

    hidden = (serial - prefetched) / transfer
    gained = (without a plan - prefetched) / its transfer

``gained`` is the forward's time saved against the path without a plan, in its own transfers: it is lower
than ``hidden`` by the host work that keeping a chunk in flight adds per chunk (the plan's next chunk, its
hand-over between workspace and buffer, the wait for it), which a sleep stand-in keeps on the host thread
and a device's kernels run behind. Beside them, what the prefetched forward's stream calls took on the host
besides their waits and the owner's gathers: gloo's launches, each timed through the device API (serial
counts a launch in its chunk's transfer, a prefetched forward cannot hide it), and the runtime's own work
(the same calls in both runs). Launches over 0.2 ms are counted apart: a launch is a few tens of
microseconds, unless the host thread waits for a core that the sends' threads hold (gloo's workers of both
ranks on 2 cores). For comparison the benchmark also launches broadcasts alone, a chunk's and one of 16
values, each completed before the next, and reports the 90th percentile of each. A device's launch is
microseconds.

The whole measurement runs three times, each on new rank processes: as is; then with the threads that gloo
starts for the exchange group (its TCP loop and its workers) at idle priority (``SCHED_IDLE``): they run when
a core is free and never keep the host thread from one, as a device's transfer never takes the host's core;
then, gloo's threads still idle, with the side stream modeled by a thread (`SideStreamThread`, a device API
of this benchmark; the runtime is the same): every broadcast is handed to one worker thread, which launches
it on a twin group of the same ranks, so the host thread pays the hand-over instead of gloo's launch, as it
pays a kernel launch on a device. Its transfer includes the hand-over and the thread's wake-up. Each run
reports its transfer and its stand-in per chunk, and the stand-in against the transfer it was timed with.
The first two runs launch from the host thread; the second shows how much of the first's loss is the
contention, the third how much of the rest is gloo's launch on the host thread.

A first forward of each run (not timed) checks every chunk each rank received against the owner's rows.

    python benchmarks/history_overlap.py [--layers 8] [--history 16384] [--chunk 2048] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from _common import summary, write_result

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.launch import run_ranks
from kvpp_fx.runtime.context_rows import AheadChunk
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.runtime.timeline import Timeline
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

WIDTH, BLOCK = 576, 16  # DeepSeek's latent row (bfloat16), vLLM's block on CUDA
GATHERING = [0.0]  # the owner's time in its gathers, this forward
STALL = 200e-6  # a launch longer than this waited for a core


class TimedLaunches(DeviceAPI):
    """The CPU device API, timing each broadcast's launch on the host thread (every run has one)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.launches: list[float] = []

    def broadcast(self, tensor, src, group):
        start = time.perf_counter()
        try:
            return super().broadcast(tensor, src, group)
        finally:
            self.launches.append(time.perf_counter() - start)


class SideStreamThread(TimedLaunches):
    """A device's side stream, modeled on CPU: one worker thread launches every broadcast, in the order the
    host thread hands them over (so the ranks pair them as before), on a twin of the exchange group that
    nothing else uses. The host thread pays the hand-over, timed as the launch; waiting for a broadcast
    waits for the thread's launch of it, then for gloo's completion, bounded by the runtime's timeout."""

    def __init__(self, twins: dict) -> None:
        super().__init__()
        self.twins = twins
        self.handed: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._launch_in_order, daemon=True).start()

    def _launch_in_order(self) -> None:
        while True:
            launched, tensor, src, group = self.handed.get()
            try:
                launched.set_result(dist.broadcast(tensor, src=src, group=group, async_op=True))
            except Exception as exc:  # the wait raises it
                launched.set_exception(exc)

    def broadcast(self, tensor, src, group):
        start = time.perf_counter()
        launched: Future = Future()
        self.handed.put((launched, tensor, src, self.twins[group]))
        self.launches.append(time.perf_counter() - start)
        return launched

    def wait_work(self, work, timeout: timedelta) -> None:
        if isinstance(work, Future):  # a broadcast (the runtime's other collectives stay on the host thread)
            work = work.result(timeout.total_seconds())
        work.wait(timeout)

    def host_wait_work(self, work, timeout: timedelta) -> None:
        self.wait_work(work, timeout)


class Chunks:
    """One layer's history as vLLM's MLA prefill reads it: chunk c is tokens ``c*chunk..(c+1)*chunk`` of the
    layer's cache, gathered into the front of one workspace."""

    def __init__(self, runtime: KVPPRuntime, layer: int, workspace: torch.Tensor, count: int) -> None:
        self.runtime, self.layer, self.workspace, self.count = runtime, layer, workspace, count
        self.index = 0

    def gather(self, into: torch.Tensor, layer: int, chunk: int):
        tokens = into.shape[0]
        rows = self.runtime.typed_views(layer)["kv"].view(-1, WIDTH)[chunk * tokens:(chunk + 1) * tokens]

        def run():
            start = time.perf_counter()
            into.copy_(rows)
            GATHERING[0] += time.perf_counter() - start
        return run

    def key(self) -> tuple:
        return (self.layer, self.index)

    def adopt(self, buffer: torch.Tensor) -> torch.Tensor:
        """As vLLM's plan: the workspace takes the buffer's bytes, the buffer the workspace's former ones."""
        workspace = self.workspace
        former = torch.empty(0, dtype=workspace.dtype).set_(workspace.untyped_storage(), workspace.storage_offset(),
                                                            workspace.shape, workspace.stride())
        workspace.set_(buffer.untyped_storage(), buffer.storage_offset(), buffer.shape, buffer.stride())
        return former

    def ahead(self, buffer: torch.Tensor, next_layer: int | None) -> AheadChunk | None:
        if self.index + 1 < self.count:
            layer, chunk = self.layer, self.index + 1
        elif next_layer is not None:
            layer, chunk = next_layer, 0
        else:
            return None
        return AheadChunk(layer, (layer, chunk), buffer, self.gather(buffer, layer, chunk))


def expected(layer: int, chunk: int, tokens: int) -> torch.Tensor:
    return torch.full((tokens, WIDTH), float(layer * 100 + chunk), dtype=torch.bfloat16)


def threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def at_idle_priority(tids: set[int]) -> None:
    if not tids:
        raise RuntimeError("no thread started with the exchange group: nothing to run at idle priority")
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:
            raise RuntimeError(f"this host refuses SCHED_IDLE for gloo's thread {tid} ({exc}); run with "
                               "--as-is-only") from exc


def worker(rank, world, layers, history, chunk_tokens, repeats, idle_transfer_threads, side_stream_thread):
    blocks = history // BLOCK + 1
    spec = ModelCacheSpec("bench", BLOCK, tuple(LayerCacheSpec(i, (ComponentSpec("kv", "bfloat16", (WIDTH,)),))
                                               for i in range(layers)))
    plan = KVPPPlan(spec, group_size=world, scratch_blocks=8)  # compact slots: history streams, slots stay small
    before = threads()
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    twin = dist.new_group(dist.get_process_group_ranks(group), timeout=timedelta(seconds=60)) \
        if side_stream_thread else None
    gloo_threads = threads() - before  # the exchange group's (and its twin's): gloo's TCP loop and its workers
    if idle_transfer_threads:
        at_idle_priority(gloo_threads)
    storage = allocate_cache(plan, dist.get_rank(group), blocks)
    count = history // chunk_tokens
    for layer in plan.owned_layers(rank):  # each chunk of the owner's history holds layer * 100 + chunk
        rows = storage.typed_views(layer)["kv"].view(-1, WIDTH)
        for c in range(count):
            rows[c * chunk_tokens:(c + 1) * chunk_tokens] = float(layer * 100 + c)
    workspace = torch.empty(chunk_tokens, WIDTH, dtype=torch.bfloat16)

    in_calls = [0.0]  # the forward's time inside its stream calls

    def forward_time(runtime, seconds, prefetch, check=False):
        wrong = []
        in_calls[0] = GATHERING[0] = 0.0
        runtime.api.launches.clear()

        def attend(layer):
            chunks = Chunks(runtime, layer, workspace, count)
            for c in range(count):
                chunks.index = c
                called = time.perf_counter()
                runtime.open_turn.stream_history(workspace, chunks.gather(workspace, layer, c),
                                                   chunks if prefetch else None)
                in_calls[0] += time.perf_counter() - called
                if seconds:
                    time.sleep(seconds)  # the chunk's attention
                if check and not torch.equal(workspace, expected(layer, c, chunk_tokens)):
                    wrong.append((layer, c))

        dist.barrier()
        start = time.perf_counter()
        with runtime.forward(has_history=False, history_ahead=prefetch):
            schedule = runtime.plan.schedule()
            runtime.prefetch(schedule.first().layer, schedule.first().slot)
            for step in list(schedule.steps())[1:]:
                if step.kind == "wait":
                    runtime.wait(step.layer, step.slot)
                    attend(step.layer)
                else:
                    runtime.prefetch(step.layer, step.slot)
        elapsed = time.perf_counter() - start
        if wrong:
            raise AssertionError(f"rank {rank} read other rows than the owner's for chunks {wrong[:5]}")
        return elapsed

    def device_api():
        return SideStreamThread({group: twin}) if side_stream_thread else TimedLaunches()

    def create(**options):
        return KVPPRuntime.create(plan, storage, group, timeline=Timeline(rank), device_api=device_api(), **options)

    def launched_alone(values, times=40):
        api, payload, took = device_api(), torch.zeros(values, dtype=torch.bfloat16), []
        for _ in range(times):
            dist.barrier(group)
            work = api.broadcast(payload, dist.get_global_rank(group, 0), group)
            took.append(api.launches[-1])
            api.host_wait_work(work, timedelta(seconds=60))
        return sorted(took)[int(0.9 * times)]

    alone_p90 = {"chunk": launched_alone(chunk_tokens * WIDTH), "16 values": launched_alone(16)}
    # the stand-in: 1.2x a chunk's transfer as the serial run measures it (the mean of its spans, chunks spaced
    # by compute), from a probe of this run's processes, its last forward sized by the one before
    probe, seconds = create(overlap=False), 1e-3
    for _ in range(3):
        before = len(probe.timeline.events)
        forward_time(probe, seconds, True)
        seconds = 1.2 * statistics.fmean(e["dur"] for e in probe.timeline.events[before:]
                                         if e["cat"] == "history") / 1e6
    probe.close()
    planless_rt, serial_rt, prefetch_rt = create(), create(overlap=False), create()
    for runtime, prefetch in ((planless_rt, False), (serial_rt, True), (prefetch_rt, True)):
        forward_time(runtime, seconds, prefetch, check=True)
    serial, prefetched, transfer, waited, in_prefetched_calls, gathering = [], [], [], [], [], []
    launching, stalled, launch_us = [], [], []
    planless, planless_transfer, compute, hidden, gained = [], [], [], [], []
    chunks = layers * count

    def timed(runtime, prefetch, times, transfers):
        before = len(runtime.timeline.events)
        times.append(forward_time(runtime, seconds, prefetch))
        transfers.append(sum(e["dur"] for e in runtime.timeline.events[before:] if e["cat"] == "history") / 1e6)

    for _ in range(repeats):  # each repeat's three forwards take one stand-in: 1.2x the last serial transfer
        compute.append(seconds)
        timed(planless_rt, False, planless, planless_transfer)
        timed(serial_rt, True, serial, transfer)
        before = len(prefetch_rt.timeline.events)
        prefetched.append(forward_time(prefetch_rt, seconds, True))
        hidden.append((serial[-1] - prefetched[-1]) / transfer[-1])
        gained.append((planless[-1] - prefetched[-1]) / planless_transfer[-1])
        seconds = 1.2 * transfer[-1] / chunks
        in_prefetched_calls.append(in_calls[0])
        gathering.append(GATHERING[0])
        launches = prefetch_rt.api.launches
        launching.append(sum(launches))
        stalled.append(sum(t for t in launches if t > STALL))
        launch_us.append(statistics.median(launches) * 1e6)
        # the calls' waits for chunks in flight, and the first chunk, which nothing precedes
        events = prefetch_rt.timeline.events[before:]
        first = next(e["dur"] for e in events if e["cat"] == "history")
        waited.append((first + sum(e["dur"] for e in events if e["cat"] == "history wait")) / 1e6)
    found_in_flight = prefetch_rt.stats()["context_ahead"]
    planless_rt.close(), serial_rt.close(), prefetch_rt.close()
    return {"serial": serial, "prefetched": prefetched, "transfer": transfer, "waited": waited,
            "in_prefetched_calls": in_prefetched_calls, "gathering": gathering, "launching": launching,
            "stalled_launches": stalled, "median_launch_us": launch_us,
            "launched_alone_p90_us": {k: v * 1e6 for k, v in alone_p90.items()},
            "without_plan": planless, "without_plan_transfer": planless_transfer,
            "compute_per_chunk_s": compute, "hidden": hidden, "gained": gained,
            "chunk_bytes": chunk_tokens * WIDTH * 2, "chunks_per_forward": chunks,
            "found_in_flight": found_in_flight, "forwards": repeats + 1, "gloo_threads": len(gloo_threads)}


TIMED = ("serial", "prefetched", "transfer", "waited", "in_prefetched_calls", "gathering", "launching",
         "stalled_launches", "without_plan", "without_plan_transfer")


def figures(res: dict) -> dict:
    """One run's figures: the fractions the median of each repeat's, the times the medians over the forwards."""
    med = {k: statistics.median(res[k]) for k in TIMED}
    own_work = med["in_prefetched_calls"] - med["waited"] - med["gathering"] - med["launching"]
    chunks = res["chunks_per_forward"]
    return {"seconds": {k: summary(res[k]) for k in TIMED}, "medians": med,
            "compute_per_chunk_ms": statistics.median(res["compute_per_chunk_s"]) * 1e3,
            "transfer_per_chunk_ms": med["transfer"] / chunks * 1e3,
            "compute_of_transfer": statistics.median(c / (t / chunks) for c, t in zip(res["compute_per_chunk_s"],
                                                                                      res["transfer"])),
            "found_in_flight_per_forward": res["found_in_flight"] / res["forwards"],
            "hidden_fraction": statistics.median(res["hidden"]),
            "gained_against_no_plan": statistics.median(res["gained"]),
            "transfer_not_waited_for": 1 - med["waited"] / med["transfer"],
            "launches_of_transfer": med["launching"] / med["transfer"],
            "stalled_launches_of_transfer": med["stalled_launches"] / med["transfer"],
            "median_launch_us": statistics.median(res["median_launch_us"]),
            "launched_alone_p90_us": res["launched_alone_p90_us"],
            "runtime_work_of_transfer": own_work / med["transfer"], "own_work": own_work,
            "gloo_threads": res["gloo_threads"]}


def show(title: str, f: dict, res: dict) -> None:
    med, own_work = f["medians"], f["own_work"]
    print(f"{title}: transfer {f['transfer_per_chunk_ms']:.2f} ms/chunk, compute {f['compute_per_chunk_ms']:.2f} "
          f"ms/chunk ({f['compute_of_transfer']:.2f}x); {f['found_in_flight_per_forward']:.0f} of "
          f"{res['chunks_per_forward']} chunks found in flight per forward")
    print(f"serial {med['serial'] * 1e3:.1f} ms  prefetched {med['prefetched'] * 1e3:.1f} ms  "
          f"transfer {med['transfer'] * 1e3:.1f} ms  -> hidden fraction {f['hidden_fraction']:.3f}")
    print(f"without a plan {med['without_plan'] * 1e3:.1f} ms, transfer {med['without_plan_transfer'] * 1e3:.1f} ms "
          f"-> prefetched gains {f['gained_against_no_plan']:.3f} of it")
    print(f"the calls waited {med['waited'] * 1e3:.1f} ms for chunks (the first included) -> "
          f"{f['transfer_not_waited_for']:.3f} of the transfer not waited for")
    print(f"the stream calls took {med['in_prefetched_calls'] * 1e3:.1f} ms: the waits, "
          f"{med['gathering'] * 1e3:.1f} ms of the owner's gathers (as serial), {med['launching'] * 1e3:.1f} ms of "
          f"gloo's launches ({f['launches_of_transfer']:.3f} of the transfer; median launch "
          f"{f['median_launch_us']:.0f} us, {med['stalled_launches'] * 1e3:.1f} ms in launches over "
          f"{STALL * 1e6:.0f} us) and {own_work * 1e3:.1f} ms of the runtime's own work "
          f"({f['runtime_work_of_transfer']:.3f})")
    alone = f["launched_alone_p90_us"]
    print(f"launched alone, 9 of 10 launches took under {alone['chunk']:.0f} us for a chunk, "
          f"{alone['16 values']:.0f} us for 16 values")


RUNS = {"as is": (False, False), "idle": (True, False), "side stream thread": (True, True)}  # idle, side thread


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--history", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    parser.add_argument("--as-is-only", action="store_true",
                        help="skip the runs with gloo's threads at idle priority and with a side stream thread")
    args = parser.parse_args(argv)
    runs = {}
    for name in ("as is",) if args.as_is_only else RUNS:
        idle, side_thread = RUNS[name]
        res = run_ranks(worker, 2, args.layers, args.history, args.chunk, args.repeats, idle, side_thread,
                        timeout_s=600)[0]
        runs[name] = (res, figures(res))
        show(f"{args.layers} layers, {args.history}-token history in {args.chunk}-token chunks "
             f"({res['chunk_bytes'] / 2**20:.2f} MiB), {name} (gloo's {res['gloo_threads']} threads"
             + (" at idle priority)" if idle else ")"), runs[name][1], res)
    res, as_is = runs["as is"]
    keep = ("hidden_fraction", "gained_against_no_plan", "transfer_not_waited_for", "launches_of_transfer",
            "stalled_launches_of_transfer", "median_launch_us", "launched_alone_p90_us", "runtime_work_of_transfer",
            "compute_per_chunk_ms", "transfer_per_chunk_ms", "compute_of_transfer", "found_in_flight_per_forward")
    result = {"layers": args.layers, "history_tokens": args.history, "chunk_tokens": args.chunk,
              "chunk_bytes": res["chunk_bytes"], "chunks_per_forward": res["chunks_per_forward"],
              "seconds": as_is["seconds"], **{k: as_is[k] for k in keep}, "stall_us": STALL * 1e6, "goal": 0.9}
    for name, key in (("idle", "idle_transfer_threads"), ("side stream thread", "side_stream_thread")):
        if name in runs:
            result[key] = {"seconds": runs[name][1]["seconds"], **{k: runs[name][1][k] for k in keep}}
    write_result("history_overlap", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
