"""Prefill history streamed from each layer's owner (`ContextRows`, through `LayerTurn.stream_history`) on
real gloo ranks: the owner gathers a chunk out of its own cache, every rank receives it into the same
buffer, and nothing else gathers."""

from __future__ import annotations

import pytest
import torch

from kvpp_fx.runtime import errors as E
from tests.support.faults import SkippedHistory, WrongRankHistory
from tests.support.launch import kvpp_group, launch
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

        rt.turn(layer).stream_history(rows, gather)
        received[layer] = rows.clone()

    with rt.forward(has_history=False):
        run_layers(rt, attend)
    errors = {}
    with rt.forward(has_history=False):
        schedule = rt.plan.schedule()
        rt.prefetch(schedule.first().layer, schedule.first().slot)
        rt.wait(0, schedule.slot(0))
        turn = rt.turn(0)
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
            assert torch.equal(rows, owners_chunk(layer)), (rank, layer)
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
             if not torch.equal(rows, owners_chunk(layer))}
    if fault == "wrong-rank":  # every rank ends with the non-owner's unfilled rows
        assert wrong == {(rank, layer) for rank in (0, 1) for layer in range(4)}
    else:  # each receiver keeps its own rows; each owner its gathered ones
        assert wrong == {(0, 2), (0, 3), (1, 0), (1, 1)}
