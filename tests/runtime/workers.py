"""Rank functions for the multi-rank runtime tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import contextlib
import os
import random
import resource
import time
import tracemalloc
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.runtime import errors as E
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups
from tests.runtime.ordering import RecordingDeviceAPI, check_happens_before

WIDTH, BLOCK, BLOCKS = 8, 4, 16


def toy_spec(num_layers: int) -> ModelCacheSpec:
    comps = (ComponentSpec("kv", "float32", (WIDTH,)),)
    return ModelCacheSpec("toy", BLOCK, tuple(LayerCacheSpec(i, comps) for i in range(num_layers)))


def build_runtime(rank: int, world: int, tp: int, pp: int, num_layers: int, *, pg_timeout_s: float = 20.0,
                  **kwargs) -> KVPPRuntime:
    groups = kvpp_groups(world, tp=tp, pp=pp)
    group = create_kvpp_process_groups(groups, timeout=timedelta(seconds=pg_timeout_s))
    stage = rank // tp
    per_stage = num_layers // pp
    plan = KVPPPlan(toy_spec(num_layers), group_size=tp,
                    layers=tuple(range(stage * per_stage, (stage + 1) * per_stage)))
    storage = allocate_cache(plan, dist.get_rank(group), BLOCKS)
    return KVPPRuntime.create(plan, storage, group, **kwargs)


def fresh_runtime(world: int, num_layers: int, timeout_s: float, **kwargs) -> KVPPRuntime:
    """A runtime over a new process group of all ranks (every rank must call it, in the same order)."""
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s))
    plan = KVPPPlan(toy_spec(num_layers), group_size=world)
    return KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), BLOCKS), group, **kwargs)


def pattern(forward: int, layer: int) -> torch.Tensor:
    return (torch.arange(BLOCKS * BLOCK * WIDTH, dtype=torch.float32) + forward * 10_000 + layer * 100
            ).view(BLOCKS, BLOCK, WIDTH)


def run_layers(rt: KVPPRuntime, on_wait, after_prefetch=None) -> None:
    """Issue the ops exactly as the rewritten graph does: prefetch(first), then wait(L); prefetch(next)."""
    layers = rt.plan.target_layers
    rt.prefetch(layers[0], rt.plan.slot(layers[0]))
    if after_prefetch is not None:
        after_prefetch(layers[0])
    for layer in layers:
        view = rt.wait(layer, rt.plan.slot(layer))
        nxt = rt.plan.next_target(layer)
        if nxt is not None:
            rt.prefetch(nxt, rt.plan.slot(nxt))
            if after_prefetch is not None:
                after_prefetch(nxt)
        on_wait(layer, view)


def write_owned(rt: KVPPRuntime, forward: int) -> None:
    for layer in rt.plan.owned_layers(rt.rank):
        rt.typed_views(layer)["kv"].copy_(pattern(forward, layer))


def correctness_worker(rank: int, world: int, tp: int, pp: int, num_layers: int, forwards: int):
    rt = build_runtime(rank, world, tp, pp, num_layers)
    me = rt.rank
    mismatches, records = [], []
    for f in range(forwards):
        has_history = f % 3 != 0
        write_owned(rt, f)

        def check(layer, view):
            typed = rt.typed_views(layer)["kv"]
            assert typed.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            if has_history or rt.plan.owner(layer) == me:
                if not torch.equal(typed, pattern(f, layer)):
                    mismatches.append((f, layer))

        with rt.forward(has_history):
            run_layers(rt, check)
        records.append(rt.stats()["last_forward"])
    stats = rt.stats()
    rt.close()
    return {"mismatches": mismatches, "stats": stats, "records": records, "layers": list(rt.plan.target_layers),
            "owned": list(rt.plan.owned_layers(me))}


class NoWaitDeviceAPI(DeviceAPI):
    """A fault for negative controls: the broadcast is never waited for, so attention may read early."""

    def wait_work(self, work, timeout) -> None:
        pass


def race_worker(rank: int, world: int, forwards: int, fault: str | None = None):
    """Decode-like steps under random 0-20 ms issue skews; each wait's view is checked, written, re-checked."""
    rng = torch.Generator().manual_seed(1234)  # same on every rank: all ranks compute identical KV
    delay_rng = random.Random(rank)
    api = NoWaitDeviceAPI("cpu") if fault == "no-wait" else None
    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=6, device_api=api,
                       delay=lambda layer: delay_rng.uniform(0.0, 0.020))
    me = rt.rank
    reference = {layer: torch.zeros(BLOCKS, BLOCK, WIDTH) for layer in rt.plan.target_layers}
    early = []
    for step in range(forwards):
        new_tokens = {layer: torch.randn(WIDTH, generator=rng) for layer in rt.plan.target_layers}
        block, offset = divmod(step, BLOCK)

        def attend(layer, view):
            kv = rt.typed_views(layer)["kv"]
            if step > 0 and not torch.equal(kv, reference[layer]):
                early.append(("before-write", step, layer))
            kv[block, offset] = new_tokens[layer]         # the cache write of this step's token
            reference[layer][block, offset] = new_tokens[layer]
            time.sleep(0.001)                             # attention reads while the next layer streams in
            if not torch.equal(kv, reference[layer]):
                early.append(("after-write", step, layer))

        with rt.forward(has_history=step > 0):
            run_layers(rt, attend)
    if fault is not None:
        time.sleep(0.2)  # let stray broadcasts land before the group goes away
    final_ok = all(torch.equal(rt.typed_views(layer)["kv"], reference[layer]) for layer in rt.plan.owned_layers(me))
    stats = rt.stats()
    rt.close()
    return {"early": early, "final_ok": final_ok, "broadcasts": stats["broadcasts"]}


def dying_worker(rank: int, world: int, victim: int, how: str, timeout_s: float):
    """`victim` dies (``how="kill"``) or stalls alive (``"stall"``) in the middle of a forward."""
    # "kill" passes the runtime a timeout; "stall" leaves it to the process group's own
    kwargs = {"pg_timeout_s": 60.0, "timeout": timeout_s} if how == "kill" else {"pg_timeout_s": timeout_s}
    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=8, **kwargs)
    with rt.forward(has_history=True):
        run_layers(rt, lambda layer, view: None)
    start = time.monotonic()

    def maybe_die(layer, view):
        if rank == victim and layer == 2:
            if how == "kill":
                os._exit(17)
            time.sleep(timeout_s + 15.0)  # alive, but issuing no collective
            os._exit(0)

    try:
        with rt.forward(has_history=True):
            run_layers(rt, maybe_die)
    except E.TransferFailedError as exc:
        elapsed = time.monotonic() - start
        try:
            with rt.forward(has_history=True):
                pass
        except E.RuntimeBrokenError as later:
            return {"error": type(exc).__name__, "elapsed": elapsed, "later": type(later).__name__,
                    "message": str(exc)}
        return {"error": type(exc).__name__, "elapsed": elapsed, "later": None}
    return {"error": None, "elapsed": time.monotonic() - start}


class FailingDeviceAPI(DeviceAPI):
    """A fault for the failure path: the broadcast of one layer reports an error when waited for."""

    def __init__(self, failing_layer_bytes: int) -> None:
        super().__init__("cpu")
        self.calls = 0
        self.fail_at = failing_layer_bytes

    def wait_work(self, work, timeout) -> None:
        super().wait_work(work, timeout)
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError("injected transfer failure")


def failing_transfer_worker(rank: int, world: int):
    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=4, device_api=FailingDeviceAPI(3))
    seen = []
    try:
        with rt.forward(has_history=True):
            rt.prefetch(0, 0)
            rt.wait(0, 0)
            rt.prefetch(1, 1)
            rt.wait(1, 1)
            rt.prefetch(2, 0)
            try:
                rt.wait(2, 0)
            except E.TransferFailedError as exc:
                seen.append(("wait", type(exc).__name__, str(exc), type(exc.__cause__).__name__))
            try:
                rt.prefetch(3, 1)
            except E.RuntimeBrokenError as exc:
                seen.append(("prefetch", type(exc).__name__, str(exc)))
    except Exception as exc:  # the forward must not mask anything at exit
        seen.append(("exit", type(exc).__name__, str(exc)))
    for has_history in (False, True):  # broken for good, with or without history
        try:
            with rt.forward(has_history=has_history):
                seen.append(("entered", has_history))
        except E.RuntimeBrokenError as exc:
            seen.append(("later", type(exc).__name__, str(exc)))
    seen.append(("stats-broken", rt.stats()["broken"]))
    rt.close()
    return seen


# --- aborted forwards ---------------------------------------------------------------------------------

class Abort(Exception):
    """The stand-in for any exception a model raises mid-forward."""


def _no_break(self, cause):  # fault: forget that the group may be out of step
    pass


def abort_worker(rank: int, world: int, trials: int, later_forwards: int, mode: str, fault: str | None):
    """Each trial: a fresh group; forward 0 runs clean, forward 1 aborts, then `later_forwards` forwards.

    ``mode="after-first"``: every rank raises right after ``prefetch(first)``, with a random 0-20 ms skew.
    ``mode="mixed"``: rank 0 raises before its first prefetch, the others right after it.
    Returns, per trial, what each later forward did: "exact", "broken", "failed:<Error>" or "wrong".
    """
    if fault == "no-break":
        KVPPRuntime._break = _no_break
    skew = random.Random(rank * 7919 + 17)
    outcomes, wrong = [], []
    for trial in range(trials):
        rt = fresh_runtime(world, num_layers=4, timeout_s=4.0, timeout=3.0)
        forward = 0
        write_owned(rt, forward)
        with rt.forward(has_history=True):
            run_layers(rt, lambda layer, view: None)
        forward += 1
        write_owned(rt, forward)
        first = rt.plan.target_layers[0]
        try:
            with rt.forward(has_history=True):
                if mode == "mixed" and rank == 0:
                    raise Abort("before the first prefetch")
                rt.prefetch(first, rt.plan.slot(first))
                time.sleep(skew.uniform(0.0, 0.020))
                raise Abort("after the first prefetch")
        except Abort:
            pass
        trial_outcomes = []
        for _ in range(later_forwards):
            forward += 1
            write_owned(rt, forward)
            f = forward

            def check(layer, view, f=f):
                if not torch.equal(rt.typed_views(layer)["kv"], pattern(f, layer)):
                    wrong.append((trial, f, layer))
                    raise E.KVPPRuntimeError(f"wrong bytes for layer {layer}")

            try:
                with rt.forward(has_history=True):
                    run_layers(rt, check)
                trial_outcomes.append("exact")
            except E.RuntimeBrokenError:
                trial_outcomes.append("broken")
            except E.KVPPRuntimeError as exc:
                trial_outcomes.append("wrong" if "wrong bytes" in str(exc) else f"failed:{type(exc).__name__}")
        outcomes.append(trial_outcomes)
        rt.close()
        time.sleep(0.05)
    return {"outcomes": outcomes, "wrong": wrong}


# --- protocol errors on real ranks --------------------------------------------------------------------

def one_rank_errs_worker(rank: int, world: int, timeout_s: float):
    """Rank 0 makes a protocol error mid-forward; rank 1 carries on. Neither may hang."""
    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=4, timeout=timeout_s)
    start = time.monotonic()
    try:
        with rt.forward(has_history=True):
            rt.prefetch(0, 0)
            rt.wait(0, 0)
            if rank == 0:
                rt.wait(1, 1)  # nothing pending: WaitMismatchError
            rt.prefetch(1, 1)
            rt.wait(1, 1)
            rt.prefetch(2, 0)
            rt.wait(2, 0)
    except E.KVPPRuntimeError as exc:
        return {"error": type(exc).__name__, "elapsed": time.monotonic() - start,
                "broken": rt.broken is not None}
    return {"error": None, "elapsed": time.monotonic() - start}


# --- overlap ------------------------------------------------------------------------------------------

def overlap_handshake_worker(rank: int, world: int, signal_dir: str, overlap: bool, deadline_s: float):
    """The owner issues each broadcast only once its peer has *returned* from the same prefetch.

    If a prefetch completed its broadcast before returning, the receiver would never return, the
    owner's hook would give up after `deadline_s`, and the forward would fail.
    """
    folder = Path(signal_dir)
    forward = {"n": 0}

    def owner_waits_for_peer(layer: int) -> float:
        if rt.plan.owner(layer) != rank:
            return 0.0
        flag = folder / f"returned-f{forward['n']}-L{layer}"
        end = time.monotonic() + deadline_s
        while not flag.exists():
            if time.monotonic() > end:
                raise TimeoutError(f"rank {1 - rank} never returned from prefetch({layer})")
            time.sleep(0.002)
        return 0.0

    def returned_from_prefetch(layer: int) -> None:
        if rt.plan.owner(layer) != rank:
            (folder / f"returned-f{forward['n']}-L{layer}").touch()

    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=4, timeout=deadline_s + 2,
                       delay=owner_waits_for_peer, overlap=overlap)
    try:
        for f in range(3):
            forward["n"] = f
            write_owned(rt, f)
            wrong = []
            with rt.forward(has_history=True):
                run_layers(rt, lambda layer, view: wrong.append(layer) if not torch.equal(
                    rt.typed_views(layer)["kv"], pattern(f, layer)) else None, after_prefetch=returned_from_prefetch)
            assert not wrong, wrong
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True}


# --- device ordering ------------------------------------------------------------------------------------

def ordering_worker(rank: int, world: int, drop_waits_on: tuple[str, ...], forwards: int,
                    side_stream: bool = False):
    """Run decode-like forwards with a recording device API and check the happens-before relation.

    With ``side_stream`` the later forwards run under another current stream (as under a CUDA-graph
    capture or a user's stream context): the runtime must order against that stream, not the default.
    """
    api = RecordingDeviceAPI(drop_waits_on)
    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=5, device_api=api)
    side = api.new_stream()
    for f in range(forwards):
        def attend(layer, view):
            api.access(view, "read", f"forward {f} attention reads L{layer}")
            api.access(view, "write", f"forward {f} attention writes L{layer}'s new token")

        on_side = side_stream and f >= forwards // 2
        if on_side and f == forwards // 2:  # switching streams: the new one first waits for the old (wait_stream)
            switch = api.new_event()
            switch.record(api.current_stream())
            side.wait_event(switch)
        with api.stream(side) if on_side else contextlib.nullcontext():
            with rt.forward(has_history=f > 0):
                run_layers(rt, attend)
    rt.close()
    report = check_happens_before(api.log)
    return {"races": report.races, "accesses": report.accesses, "collectives": report.collectives}


# --- bounded memory -------------------------------------------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def leaf_count(value) -> int:
    """How many numbers and strings a nested structure holds (its size, whatever the magnitudes)."""
    if isinstance(value, dict):
        return sum(1 + leaf_count(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(leaf_count(v) for v in value)
    return 1


def memory_worker(rank: int, world: int, forwards: int, warmup: int):
    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=4)
    sizes, rss = {}, {}
    for f in range(forwards):
        if f == warmup:
            tracemalloc.start()
            base_traced = tracemalloc.get_traced_memory()[0]
            rss["warm"] = _rss_bytes()
            sizes["warm"] = leaf_count(rt.stats())
        with rt.forward(has_history=True):
            run_layers(rt, lambda layer, view: None)
    traced = tracemalloc.get_traced_memory()[0] - base_traced
    tracemalloc.stop()
    rss["end"] = _rss_bytes()
    sizes["end"] = leaf_count(rt.stats())
    stats = rt.stats()
    rt.close()
    return {"sizes": sizes, "rss": rss, "traced_growth": traced, "forwards": stats["forwards"],
            "broadcasts": stats["broadcasts"]}


# --- active blocks ----------------------------------------------------------------------------------------

SFA_LIKE = (ComponentSpec("kv", "bfloat16", (576,)), ComponentSpec("indexer", "int8", (128,)),
            ComponentSpec("indexer_scale", "float32", (1,)))


def fill_layer(rt: KVPPRuntime, layer: int, seed: int) -> None:
    """Deterministic bytes for one layer's whole bundle (every component, every block)."""
    view = rt.view(layer)
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))


def expected_layer(rt: KVPPRuntime, layer: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    return torch.randint(0, 256, rt.view(layer).shape, dtype=torch.uint8, generator=gen)


def active_fuzz_worker(rank: int, world: int, rounds: int, fault: str | None):
    """Random active sets over a bundle of three dtypes; check every listed block, and nothing else, moved."""
    if fault is not None:
        os.environ["KVPP_TEST_FAULT"] = fault
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world), timeout=timedelta(seconds=20))
    spec = ModelCacheSpec("sfa-like", BLOCK, tuple(LayerCacheSpec(i, SFA_LIKE) for i in range(4)))
    num_blocks = 40
    plan = KVPPPlan(spec, group_size=world, staging_fraction=0.5)
    rt = KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), num_blocks), group, crossover=0.5)
    rng = random.Random(99)  # the same sets on every rank
    bpb = plan.bundle_bytes_per_block(0)
    problems, records = [], []
    for r in range(rounds):
        count = rng.randint(0, num_blocks if r % 4 == 3 else plan.staging_blocks(num_blocks))
        blocks = rng.sample(range(num_blocks), count)
        for layer in rt.plan.owned_layers(rt.rank):
            fill_layer(rt, layer, r)
        for slot in rt.storage.scratch:  # a sentinel, so a block sent by mistake shows
            slot.fill_(0xA5)

        def check(layer, view):
            if rt.plan.owner(layer) == rt.rank:
                return
            got, want = rt.storage.block_views(layer), None
            want_bytes = expected_layer(rt, layer, r)
            for where, got_c in zip(rt.plan.layout(layer, num_blocks), got):
                want_c = want_bytes[where.offset: where.offset + where.size].view(num_blocks, -1)
                whole = len(blocks) > plan.staging_blocks(num_blocks)  # sent as the whole layer
                for b in range(num_blocks):
                    expected = want_c[b] if whole or b in blocks else torch.full_like(got_c[b], 0xA5)
                    if not torch.equal(got_c[b], expected):
                        problems.append((r, layer, where.name, b, b in blocks))

        with rt.forward(has_history=True, blocks=blocks):
            run_layers(rt, check)
        records.append((count, rt.last_forward()["bytes"]))
    rt.close()
    return {"problems": problems[:20], "n_problems": len(problems), "records": records, "bpb": bpb,
            "staging_blocks": plan.staging_blocks(num_blocks), "num_blocks": num_blocks,
            "layer_bytes": rt.view(0).numel()}


class AgreementRecordingAPI(DeviceAPI):
    """Records the group each agreement all-reduce runs on."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.groups = []

    def all_reduce_max(self, tensor, group):
        self.groups.append(group)
        return super().all_reduce_max(tensor, group)


MISMATCHES = {  # rank 0's and rank 1's (has_history, blocks)
    "same-size": ((True, [1, 2, 3]), (True, [1, 2, 4])),
    "other-size": ((True, [1, 2, 3]), (True, [1, 2])),
    "set-and-whole": ((True, [1, 2]), (True, None)),
    "empty-and-set": ((True, []), (True, [5])),
    "history": ((True, None), (False, None)),
}


def mismatched_sets_worker(rank: int, world: int, cases: list[str], host_agreement: bool = False):
    """Ranks disagree on what a forward moves: every rank must raise BlockSetMismatchError before any byte
    moves, and the runtime stays usable (the agreement itself kept the group in step).

    ``host_agreement`` runs the agreement on a host-side group of its own, as on a device.
    """
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world), timeout=timedelta(seconds=20))
    agreement = None
    if host_agreement:
        agreement = create_kvpp_process_groups(kvpp_groups(world, tp=world), backend="gloo",
                                               timeout=timedelta(seconds=20))
    plan = KVPPPlan(toy_spec(4), group_size=world, staging_fraction=0.5)
    api = AgreementRecordingAPI("cpu")
    rt = KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), BLOCKS), group, timeout=5.0,
                            agreement_group=agreement, device_api=api)
    outcome = {}
    try:  # validated on each rank before the agreement: every rank refuses, nothing is issued
        with rt.forward(has_history=True, blocks=[0, BLOCKS]):
            pass
    except E.InvalidBlocksError as exc:
        outcome["out-of-range"] = str(exc)
    for case in cases:
        has_history, blocks = MISMATCHES[case][rank]
        try:
            with rt.forward(has_history=has_history, blocks=blocks):
                run_layers(rt, lambda layer, view: None)
            outcome[case] = "ok"
        except E.KVPPRuntimeError as exc:
            outcome[case] = type(exc).__name__
    write_owned(rt, 7)
    wrong = []
    with rt.forward(has_history=True, blocks=[0, 9]):  # an agreed forward afterwards moves exact bytes
        run_layers(rt, lambda layer, view: wrong.append(layer) if not torch.equal(
            rt.typed_views(layer)["kv"][[0, 9]], pattern(7, layer)[[0, 9]]) else None)
    outcome["after"] = "exact" if not wrong else f"wrong {wrong}"
    outcome["bytes"] = rt.last_forward()["bytes"]
    outcome["agreement_groups"] = {"agreement" if g is agreement else "kvpp" if g is group else "other"
                                   for g in api.groups}
    rt.close()
    return outcome


def active_ordering_worker(rank: int, world: int, drop_waits_on: tuple[str, ...], forwards: int):
    """The staging buffer is shared by every layer's gather, broadcast and scatter: prove it is safe."""
    api = RecordingDeviceAPI(drop_waits_on)
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world), timeout=timedelta(seconds=20))
    plan = KVPPPlan(toy_spec(5), group_size=world, staging_fraction=0.5)
    rt = KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), BLOCKS), group, device_api=api)
    for f in range(forwards):
        def attend(layer, view):
            api.access(view, "read", f"forward {f} attention reads L{layer}")
            api.access(view, "write", f"forward {f} attention writes L{layer}'s new token")

        with rt.forward(has_history=f > 0, blocks=[0, 3, 5, 6][: f + 1]):
            run_layers(rt, attend)
    rt.close()
    report = check_happens_before(api.log)
    return {"races": report.races, "accesses": report.accesses, "collectives": report.collectives}


def wrong_agreement_group_worker(rank: int, world: int):
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world), timeout=timedelta(seconds=20))
    solo = create_kvpp_process_groups([[r] for r in range(world)], timeout=timedelta(seconds=20))
    plan = KVPPPlan(toy_spec(4), group_size=world)
    try:
        KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), BLOCKS), group, agreement_group=solo)
    except ValueError as exc:
        return str(exc)
    return None
