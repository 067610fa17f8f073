"""Prefill history streamed from each layer's owner (`ContextRows`, through `LayerTurn.stream_history`) on
real gloo ranks: the owner gathers a chunk out of its own cache, every rank receives it into the same
buffer, and nothing else gathers."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from kvpp_fx.runtime import errors as E
from tests.support.faults import FailingHistoryGather, SkippedHistory, WrongRankHistory
from tests.support.launch import fresh_group, kvpp_group, launch
from tests.support.toy_runtime import run_layers, toy_runtime, write_owned

pytestmark = pytest.mark.multirank

CHUNK = (slice(2, 5), slice(None), slice(None))  # blocks 2..4 of a layer: one chunk of history
FAULTS = {None: None, "wrong-rank": WrongRankHistory, "skipped": SkippedHistory}


def streaming_ranks(rank: int, world: int, fault: str | None):
    group = kvpp_group(world)
    api = FAULTS[fault]("cpu") if FAULTS[fault] is not None else None
    rt = toy_runtime(group, 4, **({"device_api": api} if api is not None else {}))
    write_owned(rt, 1)
    received, gathered = {}, []

    def attend(layer, view):
        rows = torch.full(rt.typed_views(layer)["kv"][CHUNK].shape, -1.0)

        def gather():
            gathered.append(layer)
            rows.copy_(rt.typed_views(layer)["kv"][CHUNK])

        rt.open_turn.stream_history(rows, gather)
        # by value: a tensor travels back as a shared-memory handle, which a rank that has already exited
        # can no longer hand over (FileNotFoundError in the parent, seen on a loaded host)
        received[layer] = rows.numpy().copy()

    with rt.forward(has_history=False):
        run_layers(rt, attend)
    errors = {}
    with rt.forward(has_history=False):
        schedule = rt.plan.schedule()
        rt.prefetch(schedule.first().layer, schedule.first().slot)
        rt.wait(0, schedule.slot(0))
        turn = rt.open_turn
        with pytest.raises(E.ContextStreamError, match="one contiguous buffer"):
            turn.stream_history(torch.zeros(4, 6).t(), lambda: None)
        rt.prefetch(1, schedule.slot(1))
        rt.wait(1, schedule.slot(1))
        with pytest.raises(E.OwnerRoutingError, match="layer 0 ran outside its turn .layer 1's is open"):
            turn.stream_history(torch.zeros(3), lambda: None)  # kept past layer 1's wait
        for layer in (2, 3):
            rt.prefetch(layer, schedule.slot(layer))
            rt.wait(layer, schedule.slot(layer))
        errors["checked"] = True
    stats = rt.stats()
    return {"received": received, "gathered": gathered, "owned": list(rt.plan.owned_layers(rt.rank)),
            "chunks": stats["context_chunks"], "bytes": stats["context_bytes"],
            "per_layer": {k: v["context_chunks"] for k, v in stats["per_layer"].items()}, "errors": errors,
            "broken": rt.broken is not None}


def owners_chunk(layer: int) -> torch.Tensor:
    from tests.support.toy_runtime import pattern

    return pattern(1, layer)[CHUNK]


def test_each_rank_receives_the_owners_chunk_and_only_the_owner_gathers():
    results = launch(streaming_ranks, 2, None)
    for rank, result in enumerate(results):
        assert result["gathered"] == result["owned"] == [[0, 1], [2, 3]][rank]
        for layer, rows in result["received"].items():
            assert torch.equal(torch.from_numpy(rows), owners_chunk(layer)), (rank, layer)
        nbytes = owners_chunk(0).numel() * 4
        # one chunk per layer; the owner's link carries it to the one other rank, a receiver's brings it in
        assert result["chunks"] == 4 and result["bytes"] == 4 * nbytes
        assert result["per_layer"] == {0: 1, 1: 1, 2: 1, 3: 1}
        assert result["errors"] == {"checked": True} and not result["broken"]


@pytest.mark.parametrize("fault", ["wrong-rank", "skipped"])
def test_a_chunk_from_the_wrong_rank_or_none_leaves_other_rows(fault):
    """The negative controls: broadcast from the rank that gathered nothing, or not at all."""
    results = launch(streaming_ranks, 2, fault)
    wrong = {(rank, layer) for rank, result in enumerate(results) for layer, rows in result["received"].items()
             if not torch.equal(torch.from_numpy(rows), owners_chunk(layer))}
    if fault == "wrong-rank":  # every rank ends with the non-owner's unfilled rows
        assert wrong == {(rank, layer) for rank in (0, 1) for layer in range(4)}
    else:  # each receiver keeps its own rows; each owner its gathered ones
        assert wrong == {(0, 2), (0, 3), (1, 0), (1, 1)}


def failed_gather_ranks(rank: int, world: int, timeout_s: float):
    """The owner of layer 0 (rank 0) fails to gather the layer's first history chunk, the forward's first
    collective; every rank then opens a later forward. The ranks meet on a group of their own at the end,
    so that the owner stays alive, issuing nothing, until the other ranks' broadcast has expired."""
    group = kvpp_group(world)
    meet = fresh_group(world, 60.0)
    rt = toy_runtime(group, 4, timeout=timeout_s)
    write_owned(rt, 1)
    gather = FailingHistoryGather()
    rows = torch.full(rt.typed_views(0)["kv"][CHUNK].shape, -1.0)
    out = {"owner": rt.owns(0), "error": None, "later": None}
    first = None
    start = time.monotonic()
    try:
        with rt.forward(has_history=False):
            schedule = rt.plan.schedule()
            rt.prefetch(schedule.first().layer, schedule.first().slot)
            rt.wait(0, schedule.slot(0))
            rt.open_turn.stream_history(rows, gather)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the assertions name it
        first = exc
        cause = exc.__cause__
        out["error"] = (type(exc).__name__, str(exc), f"{type(cause).__name__}: {cause}" if cause else None)
    out["elapsed"] = time.monotonic() - start
    out["gathered"] = gather.calls
    out["broken"] = rt.broken is not None and rt.broken is first
    try:
        with rt.forward(has_history=False):
            pass
    except E.KVPPRuntimeError as later:
        out["later"] = (type(later).__name__, str(later), later.__cause__ is first and first is not None)
    dist.barrier(group=meet)
    return out


def test_an_owner_whose_gather_fails_breaks_and_the_others_time_out():
    """The owner's failed gather is a `ContextStreamError` naming the layer (chained to the gather's own
    error) that breaks its runtime before anything is broadcast: a later forward raises `RuntimeBrokenError`
    naming it as the first cause. The other rank, whose broadcast the owner never joins, gets a
    `TransferTimeoutError` within the runtime's timeout, and is broken by it."""
    timeout = 2.0
    owner, other = launch(failed_gather_ranks, 2, timeout, timeout_s=90)
    assert owner["owner"] and not other["owner"]
    assert owner["gathered"] == 1 and other["gathered"] == 0  # only the owner gathers
    kind, message, cause = owner["error"] or (None, "", None)
    assert kind == "ContextStreamError", owner["error"]
    assert message.startswith("layer 0: the owner's gather of a history chunk failed"), message
    assert cause == f"RuntimeError: {FailingHistoryGather.MESSAGE}" and FailingHistoryGather.MESSAGE in message
    assert owner["broken"], "the owner's failed gather left its runtime usable"
    kind, message, chained = owner["later"] or (None, "", False)
    assert kind == "RuntimeBrokenError" and chained, owner["later"]
    assert "broken since ContextStreamError: layer 0: the owner's gather" in message
    kind, message, _ = other["error"] or (None, "", None)
    assert kind == "TransferTimeoutError", other["error"]
    assert "prefill history chunk of layer 0" in message and f"within {timeout:g}s" in message
    assert other["elapsed"] < timeout + 5.0, other
    assert other["broken"] and (other["later"] or ())[::2] == ("RuntimeBrokenError", True), other["later"]
