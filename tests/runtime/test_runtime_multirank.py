"""The runtime on real ranks: gloo on 127.0.0.1, spawned processes, timeouts everywhere.

Every correctness test here has a negative control: the same test with a deliberate fault fails. Each
case is a rank function (module level, so the spawned ranks import it from here) and a test.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import time
import tracemalloc
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kvpp_fx.cache.spec import ComponentSpec
from kvpp_fx.runtime import errors as E
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.topology import create_kvpp_process_groups
from tests.runtime.ordering import RecordingDeviceAPI, check_happens_before
from tests.runtime.test_owner_runtime import LateChecks
from tests.support.faults import DroppedBlock, DroppedBroadcast, FailingWait, SkewedBroadcasts, UnwaitedBroadcasts
from tests.support.launch import fresh_group, kvpp_group, launch
from tests.support.specs import TOY_BLOCK, TOY_WIDTH, toy_spec
from tests.support.toy_runtime import TOY_BLOCKS, pattern, run_layers, toy_runtime, write_owned

pytestmark = pytest.mark.multirank


def stage_runtime(world: int, tp: int, pp: int, num_layers: int, *, pg_timeout_s: float = 20.0,
                  **create) -> KVPPRuntime:
    """This rank's runtime over its pipeline stage's layers and its stage's KVPP group."""
    group = kvpp_group(world, tp=tp, pp=pp, timeout_s=pg_timeout_s)
    per_stage = num_layers // pp
    stage = dist.get_rank() // tp
    return toy_runtime(group, num_layers, layers=tuple(range(stage * per_stage, (stage + 1) * per_stage)), **create)


# --- every rank reads the owner's bytes -----------------------------------------------------------------

def correctness_ranks(rank: int, world: int, tp: int, pp: int, num_layers: int, forwards: int,
                      zeros_at: int | None = None):
    """``zeros_at``: the owner of that target layer position sends zeros instead of its bytes (`DroppedBroadcast`)."""
    fault = {} if zeros_at is None else {"device_api": DroppedBroadcast(torch.device("cpu"), zeros_at)}
    rt = stage_runtime(world, tp, pp, num_layers, **fault)
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


@pytest.mark.parametrize("world,tp,pp", [(2, 2, 1), (4, 4, 1), (4, 2, 2)], ids=["tp2", "tp4", "tp2xpp2"])
def test_every_rank_reads_the_owners_bytes(world, tp, pp):
    forwards = 6
    results = launch(correctness_ranks, world, tp, pp, 8, forwards)
    bytes_per_layer = TOY_BLOCKS * TOY_BLOCK * TOY_WIDTH * 4
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}"
        stage_layers = res["layers"]
        assert len(stage_layers) == 8 // pp
        assert res["stats"]["forwards"] == forwards
        for f, record in enumerate(res["records"]):
            if f % 3 == 0:
                assert not record["has_history"] and record["broadcasts"] == 0 and record["bytes"] == 0
            else:
                assert record["layers"] == stage_layers  # once per target layer, in order
                assert record["bytes"] == len(stage_layers) * bytes_per_layer
        with_history = sum(1 for f in range(forwards) if f % 3)
        assert res["stats"]["bytes"] == with_history * len(stage_layers) * bytes_per_layer
        assert all(v == {"broadcasts": with_history, "exchanges": 0, "context_chunks": 0,
                         "bytes": with_history * bytes_per_layer}
                   for v in res["stats"]["per_layer"].values())
        # each rank keeps only its own layers, plus two scratch buffers
        assert res["stats"]["persistent_layers"] == res["owned"]
        assert res["stats"]["scratch_buffers"] == 2
    owned = sorted(layer for res in results for layer in res["owned"])
    assert owned == list(range(8))


def test_negative_control_a_layer_sent_as_zeros_is_read_wrong_exactly_where_it_is_received():
    results = launch(correctness_ranks, 2, 2, 1, 8, 6, 2)
    layer = results[0]["layers"][2]
    for res in results:
        received = layer not in res["owned"]
        assert res["mismatches"] == ([(f, layer) for f in range(6) if f % 3] if received else []), res["mismatches"]
    assert sum(layer in res["owned"] for res in results) == 1


# --- races under random skews -----------------------------------------------------------------------------

class UnwaitedSkewedBroadcasts(UnwaitedBroadcasts, SkewedBroadcasts):
    """The race's negative control: skewed broadcasts that are never waited for."""


def race_ranks(rank: int, world: int, forwards: int, fault: str | None = None):
    """Decode-like steps under random 0-20 ms issue skews; each wait's view is checked, written, re-checked."""
    rng = torch.Generator().manual_seed(1234)  # same on every rank: all ranks compute identical KV
    api = (UnwaitedSkewedBroadcasts if fault == "no-wait" else SkewedBroadcasts)("cpu", max_s=0.020, seed=rank)
    rt = stage_runtime(world, world, 1, 6, device_api=api)
    me = rt.rank
    reference = {layer: torch.zeros(TOY_BLOCKS, TOY_BLOCK, TOY_WIDTH) for layer in rt.plan.target_layers}
    early = []
    for step in range(forwards):
        new_tokens = {layer: torch.randn(TOY_WIDTH, generator=rng) for layer in rt.plan.target_layers}
        block, offset = divmod(step, TOY_BLOCK)

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


@pytest.mark.parametrize("fault", [None, "no-wait"], ids=["runtime", "negative-control-no-wait"])
def test_race_random_skews_never_read_a_view_early(fault):
    forwards = 40
    results = launch(race_ranks, 2, forwards, fault, timeout_s=180)
    if fault is None:
        for res in results:
            assert res["early"] == []
            assert res["final_ok"]
            assert res["broadcasts"] == (forwards - 1) * 6
    else:  # without the wait, attention reads and writes slots the broadcast has not filled yet
        assert any(res["early"] for res in results)


# --- failures -----------------------------------------------------------------------------------------------

def dying_ranks(rank: int, world: int, victim: int, how: str, timeout_s: float, device_path: bool = False):
    """`victim` dies (``how="kill"``) or stalls alive (``"stall"``) in the middle of a forward."""
    # "kill" passes the runtime a timeout; "stall" leaves it to the process group's own
    kwargs = {"pg_timeout_s": 60.0, "timeout": timeout_s} if how == "kill" else {"pg_timeout_s": timeout_s}
    if device_path:  # the transfer stream, its events and the compute stream's waits, recorded
        kwargs["device_api"] = RecordingDeviceAPI()
    rt = stage_runtime(world, world, 1, 8, **kwargs)
    with rt.forward(has_history=True):
        run_layers(rt)
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


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_dead_or_stalled_peer_becomes_an_error_within_the_timeout(how):
    timeout = 3.0
    results = launch(dying_ranks, 3, 1, how, timeout, timeout_s=90, may_die={1})
    assert results[1] is None or how == "stall"
    for rank in (0, 2):
        res = results[rank]
        assert res["error"] in ("TransferFailedError", "TransferTimeoutError"), res
        assert res["elapsed"] < timeout + 5.0, res
        assert res["later"] == "RuntimeBrokenError", res
    if how == "stall":  # alive but silent: only the timeout can tell
        assert {results[r]["error"] for r in (0, 2)} == {"TransferTimeoutError"}


def test_a_dead_peer_on_the_device_path_becomes_an_error_within_the_timeout():
    """The device path (transfer stream, events, the compute stream's waits) with a peer that dies in the
    middle of a forward: every other rank raises a named error within the runtime's timeout, and stays
    broken. On NCCL the host does not wait for a layer's broadcast: there the bound is the communicator's
    watchdog, at the KVPP group's timeout (docs/vllm.md)."""
    timeout = 3.0
    results = launch(dying_ranks, 3, 1, "kill", timeout, True, timeout_s=90, may_die={1})
    for rank in (0, 2):
        res = results[rank]
        assert res["error"] in ("TransferFailedError", "TransferTimeoutError"), res
        assert res["elapsed"] < timeout + 5.0, res
        assert res["later"] == "RuntimeBrokenError", res


def failing_transfer_ranks(rank: int, world: int):
    rt = stage_runtime(world, world, 1, 4, device_api=FailingWait("cpu", fail_at=3))
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


def test_a_failed_transfer_breaks_the_runtime_for_good():
    for seen in launch(failing_transfer_ranks, 2, timeout_s=60):
        assert seen[0][:2] == ("wait", "TransferFailedError")
        assert "broadcast of layer 2 failed: injected transfer failure" in seen[0][2]
        assert seen[0][3] == "OSError"
        assert seen[1][:2] == ("prefetch", "RuntimeBrokenError")
        assert seen[2][:2] == ("exit", "RuntimeBrokenError")  # the caller swallowed the errors: exit raises
        assert seen[3][:2] == ("later", "RuntimeBrokenError") and seen[4][:2] == ("later", "RuntimeBrokenError")
        assert "injected transfer failure" in seen[3][2] and "new process group" in seen[3][2]
        assert seen[5][0] == "stats-broken" and "injected transfer failure" in seen[5][1]
        assert len(seen) == 6, seen


# --- aborted forwards ---------------------------------------------------------------------------------

class Abort(Exception):
    """The stand-in for any exception a model raises mid-forward."""


def abort_ranks(rank: int, world: int, trials: int, later_forwards: int, mode: str, recovery: str,
                checks: str = "immediate"):
    """Each trial: a fresh group; forward 0 runs clean, forward 1 aborts, then `later_forwards` forwards.

    ``mode="after-first"``: every rank raises right after ``prefetch(first)``, with a random 0-20 ms skew.
    ``mode="mixed"``: rank 0 raises before its first prefetch, the others right after it.
    ``mode="one-rank"``: rank 0 raises before its first prefetch, the others run the forward to its end.
    ``checks="late"``: a device's order of checks (`LateChecks`, the agreement on a host group of its own):
    the peers issue the forward's collectives without the host waiting for rank 0's agreement.
    ``recovery="none"`` keeps the runtime; ``"new-runtime"`` (the negative control) replaces it before
    each later forward by a new runtime over the same group and cache: that forgets the group may be
    out of step, as a runtime that never broke would (recovery needs a new group too).
    Returns, per trial, what each later forward did: "exact", "broken", "failed:<Error>" or "wrong".
    """
    skew = random.Random(rank * 7919 + 17)
    outcomes, wrong = [], []
    for trial in range(trials):
        dist.barrier()  # every rank is done with the last trial: a peer may still be waiting out its timeout
        group = fresh_group(world, timeout_s=4.0)
        late = {}
        if checks == "late":
            api = LateChecks("cpu")
            api.completed = True  # each forward's checks are read when the next begins, as a device's that finished
            late = {"device_api": api, "agreement_group": fresh_group(world, timeout_s=4.0)}
        rt = toy_runtime(group, 4, timeout=3.0, **late)
        forward = 0
        write_owned(rt, forward)
        with rt.forward(has_history=True):
            run_layers(rt)
        forward += 1
        write_owned(rt, forward)
        first = rt.plan.target_layers[0]
        try:
            with rt.forward(has_history=True):
                if mode in ("mixed", "one-rank") and rank == 0:
                    raise Abort("before the first prefetch")
                if mode == "one-rank":
                    run_layers(rt)
                else:
                    rt.prefetch(first, rt.plan.slot(first))
                    time.sleep(skew.uniform(0.0, 0.020))
                    raise Abort("after the first prefetch")
        except (Abort, E.KVPPRuntimeError):  # one-rank: the peers wait in vain for rank 0's broadcasts
            pass
        trial_outcomes = []
        for _ in range(later_forwards):
            if recovery == "new-runtime":
                rt = KVPPRuntime.create(rt.plan, rt.storage, group, timeout=3.0, **late)
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


@pytest.mark.parametrize("mode,checks,trials", [("after-first", "immediate", 4), ("mixed", "immediate", 4),
                                                ("one-rank", "late", 2)])
def test_an_aborted_forward_never_yields_wrong_bytes_later(mode, checks, trials):
    results = launch(abort_ranks, 2, trials, 3, mode, "none", checks, timeout_s=150)
    for rank, res in enumerate(results):
        assert res["wrong"] == [], res
        for outcomes in res["outcomes"]:
            assert set(outcomes) <= {"exact", "broken", "failed:TransferTimeoutError",
                                     "failed:TransferFailedError"}, outcomes
            assert outcomes[-1] == "broken"  # every rank ends up refusing: the group is out of step
    if mode == "after-first":  # every rank issued a broadcast and raised: all broken at once
        assert all(o == ["broken"] * 3 for res in results for o in res["outcomes"])
    if mode == "one-rank":  # rank 0 broke as it raised (its peer went on), rank 1 once its wait expired
        assert all(o == ["broken"] * 3 for res in results for o in res["outcomes"]), results


def test_negative_control_without_breaking_an_abort_yields_wrong_bytes():
    results = launch(abort_ranks, 2, 1, 3, "mixed", "new-runtime", timeout_s=150)
    assert any(res["wrong"] for res in results), results


# --- protocol errors on real ranks --------------------------------------------------------------------

def one_rank_errs_ranks(rank: int, world: int, timeout_s: float):
    """Rank 0 makes a protocol error mid-forward; rank 1 carries on. Neither may hang."""
    rt = stage_runtime(world, world, 1, 4, timeout=timeout_s)
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


def test_one_rank_raising_a_protocol_error_does_not_hang_its_peer():
    timeout = 3.0
    results = launch(one_rank_errs_ranks, 2, timeout, timeout_s=60)
    assert results[0]["error"] == "WaitMismatchError" and results[0]["broken"]
    # rank 1 waits for a broadcast rank 0 never issues: a timeout, or a closed connection once rank 0 exits
    assert results[1]["error"] in ("TransferTimeoutError", "TransferFailedError") and results[1]["broken"]
    for res in results:
        assert res["elapsed"] < timeout + 5.0


# --- overlap ------------------------------------------------------------------------------------------

class OwnerWaitsForPeer(DeviceAPI):
    """The owner issues each broadcast only once its peer has *returned* from the same prefetch.

    Both ranks issue every broadcast in the same order, so the n-th broadcast of one rank is the n-th of
    the other: the receiver leaves a flag file named by n when its prefetch returns, and the owner's
    broadcast n waits for that flag (at most `deadline_s`)."""

    def __init__(self, device, folder: Path, deadline_s: float) -> None:
        super().__init__(device)
        self.folder, self.deadline_s = folder, deadline_s
        self.issued = 0

    def flag(self, n: int) -> Path:
        return self.folder / f"returned-{n}"

    def broadcast(self, tensor, src, group):
        n, self.issued = self.issued, self.issued + 1
        if src == dist.get_rank():
            end = time.monotonic() + self.deadline_s
            while not self.flag(n).exists():
                if time.monotonic() > end:
                    raise TimeoutError(f"the peer never returned from prefetch (broadcast {n})")
                time.sleep(0.002)
        return super().broadcast(tensor, src, group)


def overlap_handshake_ranks(rank: int, world: int, signal_dir: str, overlap: bool, deadline_s: float):
    """If a prefetch completed its broadcast before returning, the receiver would never return, the
    owner's broadcast would give up after `deadline_s`, and the forward would fail."""
    api = OwnerWaitsForPeer("cpu", Path(signal_dir), deadline_s)
    rt = stage_runtime(world, world, 1, 4, timeout=deadline_s + 2, device_api=api, overlap=overlap)

    def returned_from_prefetch(layer: int) -> None:
        if rt.plan.owner(layer) != rank:
            api.flag(api.issued - 1).touch()

    try:
        for f in range(3):
            write_owned(rt, f)
            wrong = []
            with rt.forward(has_history=True):
                run_layers(rt, lambda layer, view: wrong.append(layer) if not torch.equal(
                    rt.typed_views(layer)["kv"], pattern(f, layer)) else None, after_prefetch=returned_from_prefetch)
            assert not wrong, wrong
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "negative-control-serial"])
def test_prefetch_returns_before_its_broadcast_completes(tmp_path, overlap):
    results = launch(overlap_handshake_ranks, 2, str(tmp_path), overlap, 3.0, timeout_s=60)
    if overlap:
        assert all(res["ok"] for res in results), results
    else:  # a prefetch that completes its broadcast before returning cannot pass the handshake
        assert not all(res["ok"] for res in results)
        assert any("never returned from prefetch" in (res["error"] or "") for res in results)


# --- device ordering ------------------------------------------------------------------------------------

def ordering_ranks(rank: int, world: int, drop_waits_on: tuple[str, ...], forwards: int, side_stream: bool = False,
                   blocks: tuple[int, ...] | None = None, scratch_blocks: int | None = None):
    """Decode-like forwards over a recording device API; the happens-before relation is then checked.

    With ``side_stream`` the later forwards run under another current stream (as under a CUDA-graph
    capture or a user's stream context): the runtime must order against that stream, not the default.
    With ``blocks`` forward f sends the first f + 1 of them packed: each owner gathers them into its own
    slot for the layer, the slot its attention read two layers before, and receivers receive into theirs.
    """
    api = RecordingDeviceAPI(drop_waits_on)
    rt = toy_runtime(kvpp_group(world), 5, device_api=api, scratch_blocks=scratch_blocks)
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
            with rt.forward(has_history=f > 0, blocks=list(blocks[: f + 1]) if blocks is not None else None):
                run_layers(rt, attend)
    rt.close()
    report = check_happens_before(api.log)
    return {"races": report.races, "accesses": report.accesses, "collectives": report.collectives}


@pytest.mark.parametrize("drop,side_stream", [((), False), ((), True), (("transfer",), False), (("compute",), False)],
                         ids=["runtime", "runtime-on-a-side-stream", "negative-control-no-ready-wait",
                              "negative-control-no-done-wait"])
def test_device_ordering_happens_before(drop, side_stream):
    results = launch(ordering_ranks, 2, drop, 4, side_stream, timeout_s=60)
    for res in results:
        # 3 forwards with history x 5 broadcasts, and each of the 4 forwards' agreement all-reduce
        assert res["collectives"] == 3 * 5 + 4 and res["accesses"] == 2 * 5 * 4
        if not drop:
            assert res["races"] == [], res["races"][:5]
    if drop:  # rank 1 receives layers 0-2 (slots 0, 1, 0): within a forward, slot 0 is reused
        assert results[1]["races"], "the checker must see the missing wait"
    if drop == ("transfer",):  # the broadcast into a slot races the previous reader of that slot
        assert any("broadcast" in race.split(" is not")[0] for res in results for race in res["races"])


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


def memory_ranks(rank: int, world: int, forwards: int, warmup: int):
    rt = stage_runtime(world, world, 1, 4)
    sizes, rss = {}, {}
    for f in range(forwards):
        if f == warmup:
            tracemalloc.start()
            base_traced = tracemalloc.get_traced_memory()[0]
            rss["warm"] = _rss_bytes()
            sizes["warm"] = leaf_count(rt.stats())
        with rt.forward(has_history=True):
            run_layers(rt)
    traced = tracemalloc.get_traced_memory()[0] - base_traced
    tracemalloc.stop()
    rss["end"] = _rss_bytes()
    sizes["end"] = leaf_count(rt.stats())
    stats = rt.stats()
    rt.close()
    return {"sizes": sizes, "rss": rss, "traced_growth": traced, "forwards": stats["forwards"],
            "broadcasts": stats["broadcasts"]}


def test_memory_and_stats_stay_flat_over_3000_forwards():
    results = launch(memory_ranks, 2, 3000, 300, timeout_s=300)
    for res in results:
        assert res["forwards"] == 3000 and res["broadcasts"] == 3000 * 4
        assert res["sizes"]["end"] == res["sizes"]["warm"]
        assert res["traced_growth"] < 64 * 1024, res
        assert res["rss"]["end"] - res["rss"]["warm"] < 8 * 2**20, res


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
    size = rt.storage.num_blocks * rt.plan.bundle_bytes_per_block(layer)  # the owner's whole bundle
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)


def active_fuzz_ranks(rank: int, world: int, rounds: int, fault: str | None, scratch_blocks: int | None = None):
    """Random active sets over a bundle of three dtypes; check every listed block arrived at its position
    in the packed slot, in order, and nothing else moved. With whole-layer slots a set past the
    crossover sends whole layers; compact slots always pack."""
    num_blocks = 40
    rt = toy_runtime(kvpp_group(world), spec=toy_spec(4, components=SFA_LIKE, name="sfa-like"), num_blocks=num_blocks,
                     crossover=0.5, scratch_blocks=scratch_blocks,
                     device_api=DroppedBlock("cpu") if fault == "drop-block" else None)
    plan = rt.plan
    slot_blocks = rt.storage.slot_blocks
    rng = random.Random(99)  # the same sets on every rank
    bpb = plan.bundle_bytes_per_block(0)
    problems, records = [], []
    for r in range(rounds):
        count = rng.randint(0, min(slot_blocks, num_blocks if r % 4 == 3 else num_blocks // 2))
        blocks = rng.sample(range(num_blocks), count)
        for layer in rt.plan.owned_layers(rt.rank):
            fill_layer(rt, layer, r)
        for slot in rt.storage.scratch:  # a sentinel, so a block sent by mistake shows
            slot.fill_(0xA5)
        whole = not plan.compact and count > num_blocks // 2  # sent as the whole layer

        def check(layer, view):
            if rt.plan.owner(layer) == rt.rank:
                return
            got = rt.storage.block_views(layer)
            want_bytes = expected_layer(rt, layer, r)
            for where, got_c in zip(rt.plan.layout(layer, num_blocks), got):
                want_c = want_bytes[where.offset: where.offset + where.size].view(num_blocks, -1)
                want = want_c if whole else want_c[sorted(blocks)]
                for position in range(slot_blocks):
                    expected = want[position] if position < len(want) else torch.full_like(got_c[position], 0xA5)
                    if not torch.equal(got_c[position], expected):
                        listed = whole or position < len(want)
                        problems.append((r, layer, where.name, position, listed))

        with rt.forward(has_history=True, blocks=blocks):
            run_layers(rt, check)
        records.append((count, rt.last_forward()["bytes"], whole))
    rt.close()
    return {"problems": problems[:20], "n_problems": len(problems), "records": records, "bpb": bpb,
            "num_blocks": num_blocks, "layer_bytes": plan.bundle_bytes_per_block(0) * num_blocks}


@pytest.mark.parametrize("scratch_blocks", [None, 24], ids=["whole-layer-slots", "compact-slots"])
def test_active_block_fuzz_every_listed_block_arrives_and_nothing_else(scratch_blocks):
    results = launch(active_fuzz_ranks, 2, 25, None, scratch_blocks)
    for res in results:
        assert res["n_problems"] == 0, res["problems"]
        whole_forwards = 0
        for count, nbytes, whole in res["records"]:
            if whole:  # beyond the crossover: whole layers
                assert nbytes == 4 * res["layer_bytes"]
                whole_forwards += 1
            else:  # 4 layers: the listed blocks of kv (bf16 576) + indexer (int8 128) + scale (fp32 1), and ids
                assert nbytes == 4 * count * (res["bpb"] + 8)
        if scratch_blocks is None:
            assert 0 < whole_forwards < len(res["records"])
        else:
            assert whole_forwards == 0
        assert res["bpb"] == 4 * (576 * 2 + 128 + 4)


def test_negative_control_a_dropped_block_is_missing_at_the_receiver():
    results = launch(active_fuzz_ranks, 2, 6, "drop-block")
    assert any(res["n_problems"] for res in results)
    assert all(listed for res in results for (_, _, _, _, listed) in res["problems"])  # only listed positions


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


def mismatched_sets_ranks(rank: int, world: int, cases: list[str], host_agreement: bool = False):
    """Ranks disagree on what a forward moves: every rank must raise BlockSetMismatchError before any byte
    moves, and the runtime stays usable (the agreement itself kept the group in step).

    ``host_agreement`` runs the agreement on a host-side group of its own, as on a device.
    """
    group = kvpp_group(world)
    agreement = kvpp_group(world, backend="gloo") if host_agreement else None
    api = AgreementRecordingAPI("cpu")
    rt = toy_runtime(group, 4, timeout=5.0, agreement_group=agreement, device_api=api)
    outcome = {}
    try:  # validated on each rank before the agreement: every rank refuses, nothing is issued
        with rt.forward(has_history=True, blocks=[0, TOY_BLOCKS]):
            pass
    except E.InvalidBlocksError as exc:
        outcome["out-of-range"] = str(exc)
    for case in cases:
        has_history, blocks = MISMATCHES[case][rank]
        try:
            with rt.forward(has_history=has_history, blocks=blocks):
                run_layers(rt)
            outcome[case] = "ok"
        except E.KVPPRuntimeError as exc:
            outcome[case] = type(exc).__name__
    write_owned(rt, 7)
    wrong = []
    with rt.forward(has_history=True, blocks=[0, 9]):  # an agreed forward afterwards moves exact bytes
        # a receiver holds blocks 0 and 9 at the front of its slot, an owner at their ids
        run_layers(rt, lambda layer, view: wrong.append(layer) if not torch.equal(
            rt.typed_views(layer)["kv"][[0, 9] if rt.owns(layer) else [0, 1]], pattern(7, layer)[[0, 9]]) else None)
    outcome["after"] = "exact" if not wrong else f"wrong {wrong}"
    outcome["bytes"] = rt.last_forward()["bytes"]
    outcome["agreement_groups"] = {"agreement" if g is agreement else "kvpp" if g is group else "other"
                                   for g in api.groups}
    rt.close()
    return outcome


@pytest.mark.parametrize("host_agreement", [False, True], ids=["on-the-kvpp-group", "on-a-host-group"])
def test_ranks_that_disagree_on_the_set_get_a_named_error(host_agreement):
    cases = list(MISMATCHES)
    for outcome in launch(mismatched_sets_ranks, 2, cases, host_agreement, timeout_s=60):
        assert {case: outcome[case] for case in cases} == dict.fromkeys(cases, "BlockSetMismatchError")
        assert outcome["out-of-range"] == f"blocks: block id {TOY_BLOCKS} is outside the pool of {TOY_BLOCKS} blocks."
        assert outcome["after"] == "exact"
        assert outcome["agreement_groups"] == {"agreement" if host_agreement else "kvpp"}
        assert outcome["bytes"] == 4 * 2 * (TOY_BLOCK * TOY_WIDTH * 4 + 8)


@pytest.mark.parametrize("drop,scratch_blocks", [((), None), ((), 6), (("transfer",), 6), (("compute",), 6)],
                         ids=["runtime", "runtime-compact", "negative-control-no-ready-wait",
                              "negative-control-no-done-wait"])
def test_packed_slot_reuse_is_ordered_on_the_device(drop, scratch_blocks):
    """The owner of a layer gathers its blocks into its own slot for the layer, which its attention read
    for the layer two before: rank 1 owns layers 3 and 4 of 5 and gathers them into slots 1 and 0, the
    slots it read layers 1 and 2 from. Receivers receive into the front of theirs; nobody scatters."""
    results = launch(ordering_ranks, 2, drop, 4, False, (0, 3, 5, 6), scratch_blocks, timeout_s=60)
    for res in results:
        assert res["collectives"] == 3 * 5 + 4
        if not drop:
            assert res["races"] == [], res["races"][:5]
    if drop:
        assert results[1]["races"]
    if drop == ("transfer",):  # rank 1 gathers layer 4 into slot 0, which its attention read for layer 2
        assert any("gather" in race for race in results[1]["races"]), results[1]["races"][:5]


def wrong_agreement_group_ranks(rank: int, world: int):
    group = kvpp_group(world)
    solo = create_kvpp_process_groups([[r] for r in range(world)], timeout=timedelta(seconds=20))
    try:
        toy_runtime(group, 4, agreement_group=solo)
    except ValueError as exc:
        return str(exc)
    return None


def test_an_agreement_group_of_other_ranks_is_refused():
    for message in launch(wrong_agreement_group_ranks, 2, timeout_s=60):
        assert message is not None and "agreement group's ranks" in message
