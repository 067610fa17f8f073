"""Streamed prefill history, prefetched (`ContextRows` with a `ChunkPlan`), on real gloo ranks: the next
chunk of a layer, and with ``history_ahead`` the next layer's first, is in flight while the current chunk
computes; every rank still reads the owner's rows, in the device order a recording API proves; a chunk
in flight that is not the call's is refused by name."""

from __future__ import annotations

import pytest
import torch

from kvpp_fx.runtime import errors as E
from kvpp_fx.runtime.context_rows import AheadChunk
from tests.runtime.ordering import RecordingDeviceAPI, check_happens_before, collectives_not_before
from tests.support.launch import kvpp_group, launch
from tests.support.toy_runtime import pattern, run_layers, toy_runtime, write_owned

pytestmark = pytest.mark.multirank

CHUNKS = ((0, 3), (3, 7), (7, 9))  # block ranges of a layer's history, one chunk each (3, 4 and 2 blocks)
WORKSPACE_BLOCKS = 4  # the workspace holds the largest chunk


class ToyChunks:
    """A layer's chunked history as vLLM's MLA prefill reads it: every chunk lands in the front of one
    workspace, whose rows the chunk's attention cuts after its gather returns; chunk c of layer L is blocks
    ``CHUNKS[c]`` of L's cache (its key: the block range). ``adopts``: the workspace takes the prefetch
    buffer's bytes (as vLLM's plan does), else the runtime copies the chunk."""

    def __init__(self, rt, layer: int, workspace: torch.Tensor, api, skew: int = 0, adopts: bool = True) -> None:
        self.rt, self.layer, self.workspace, self.api, self.skew, self.adopts = rt, layer, workspace, api, skew, adopts
        self.index = -1

    def adopt(self, buffer: torch.Tensor):
        if not self.adopts:
            return None
        workspace = self.workspace
        former = torch.empty(0).set_(workspace.untyped_storage(), workspace.storage_offset(), workspace.shape,
                                     workspace.stride())
        workspace.set_(buffer.untyped_storage(), buffer.storage_offset(), buffer.shape, buffer.stride())
        return former

    def rows(self, into: torch.Tensor, chunk: int) -> torch.Tensor:
        first, end = CHUNKS[chunk]
        return into[: end - first]

    def gather(self, into: torch.Tensor, layer: int, chunk: int):
        def run():
            first, end = CHUNKS[chunk]
            source = self.rt.typed_views(layer)["kv"][first:end]
            if self.api is not None:
                self.api.access(source, "read", f"owner gathers L{layer} chunk {chunk}")
                self.api.access(into, "write", f"owner gathers L{layer} chunk {chunk} into its buffer")
            self.rows(into, chunk).copy_(source)
        return run

    def key(self) -> tuple:
        return (self.layer, CHUNKS[self.index])

    def ahead(self, buffer: torch.Tensor, next_layer: int | None) -> AheadChunk | None:
        if self.index + 1 < len(CHUNKS):
            layer, chunk = self.layer, self.index + 1
        elif next_layer is not None:
            layer, chunk = next_layer, 0
        else:
            return None
        key = (layer, CHUNKS[chunk]) if not self.skew else (layer, (0, self.skew))  # skew: a wrong key
        return AheadChunk(layer, key, self.rows(buffer, chunk), self.gather(buffer, layer, chunk))


def prefetch_ranks(rank: int, world: int, ahead: bool, drop: tuple[str, ...], skew: int = 0, adopts: bool = True,
                   overlap: bool = True):
    api = RecordingDeviceAPI() if drop is not None else None
    rt = toy_runtime(kvpp_group(world), 4, overlap=overlap, **({"device_api": api} if api is not None else {}))
    if api is not None:
        api.drop_waits_on = {rt.parts.context_rows.side_stream.name if name == "history" else name for name in drop}
    write_owned(rt, 1)
    workspace = torch.full(pattern(1, 0)[:WORKSPACE_BLOCKS].shape, -1.0)
    received: dict[tuple[int, int], torch.Tensor] = {}
    context_rows = rt.parts.context_rows
    calls, in_flight, storages = [], [], set()  # per call: its chunk, the chunk then in flight; buffers seen

    def attend(layer, view):
        chunks = ToyChunks(rt, layer, workspace, api, skew, adopts)
        for chunk in range(len(CHUNKS)):
            chunks.index = chunk
            rt.open_turn.stream_history(chunks.rows(workspace, chunk), chunks.gather(workspace, layer, chunk), chunks)
            rows = chunks.rows(workspace, chunk)  # cut after the call, as vLLM's loop does
            if api is not None:
                api.access(rows, "read", f"attention reads L{layer} chunk {chunk}")
            received[layer, chunk] = rows.clone()
            calls.append((layer, chunk))
            flight = context_rows.in_flight
            in_flight.append(flight.chunk.key if flight is not None else None)  # (layer, block range)
            storages.update([workspace.data_ptr(), context_rows.buffer.data_ptr()])

    out = {"owned": list(rt.plan.owned_layers(rt.rank))}
    try:
        with rt.forward(has_history=False, history_ahead=rank == 0 if ahead == "rank 0 only" else ahead):
            run_layers(rt, attend)
    except E.KVPPRuntimeError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    wrong = sorted(key for key, rows in received.items() if not torch.equal(rows, owners_chunk(*key)))
    stats = rt.stats()
    out.update(received=sorted(received), wrong=wrong, prefetched=stats["context_ahead"], broken=rt.broken is not None,
               chunks=stats["context_chunks"], bytes=stats["context_bytes"], calls=calls, in_flight=in_flight,
               storages=len(storages))
    if api is not None:
        out["races"] = check_happens_before(api.log).races[:20]
        out["unordered"] = collectives_not_before(api.log, "attention reads")
    rt.close()
    return out


def owners_chunk(layer: int, chunk: int) -> torch.Tensor:
    first, end = CHUNKS[chunk]
    return pattern(1, layer)[first:end]


@pytest.mark.parametrize("ahead,adopts", [(True, True), (False, True), (True, False)],
                         ids=["history-ahead", "within-layers", "copied"])
def test_every_chunk_but_the_first_is_in_flight_before_its_call_and_reads_the_owners_rows(ahead, adopts):
    results = launch(prefetch_ranks, 2, ahead, None, 0, adopts, timeout_s=60)
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("error")
        assert result["wrong"] == [] and len(result["received"]) == 4 * 3, (rank, result["wrong"])
        # 4 layers of 3 chunks: only the first layer's first chunk, or each layer's first, is not prefetched
        assert result["prefetched"] == (4 * 3 - 1 if ahead else 4 * 2)
        assert result["chunks"] == 4 * 3
        assert result["bytes"] == 4 * sum(owners_chunk(0, c).numel() * 4 for c in range(3))
        # after each call the next call's chunk is in flight (with history_ahead across layers, else within
        # the layer), and the workspace and one buffer shaped like it take turns
        calls = [tuple(call) for call in result["calls"]]
        assert calls == [(layer, chunk) for layer in range(4) for chunk in range(3)]
        expected = [(calls[k + 1][0], CHUNKS[calls[k + 1][1]]) if k + 1 < len(calls) and
                    (ahead or calls[k + 1][0] == calls[k][0]) else None for k in range(len(calls))]
        assert [(key[0], tuple(key[1])) if key else None for key in result["in_flight"]] == expected
        assert result["storages"] == 2


@pytest.mark.parametrize("drop,adopts", [((), True), ((), False), (("history",), True), (("history",), False),
                                         (("compute",), True)],
                         ids=["runtime", "runtime-copied", "negative-control-no-ready-wait",
                              "negative-control-no-ready-wait-copied", "negative-control-no-done-wait"])
def test_a_prefetched_chunk_is_ordered_on_the_device(drop, adopts):
    """The owner's gather into the buffer, attention's reads of the workspace and (where the workspace
    cannot take the buffer's bytes) the copy out of the buffer run on the compute stream, the broadcast on
    the side stream between `ready` and `done`: with either wait lost, the checker finds the race."""
    results = launch(prefetch_ranks, 2, True, drop, 0, adopts, timeout_s=60)
    for rank, result in enumerate(results):
        assert "error" not in result and result["prefetched"] == 11, result.get("error")
        if not drop:
            assert result["races"] == [], result["races"][:5]
            # each chunk's wait orders attention after its own broadcast only: the next chunk stays in flight
            assert result["unordered"] == [1] * (4 * 3 - 1) + [0], result["unordered"]
        else:  # every rank receives into the buffer the copy reads (rank 1) or the gather writes (rank 0)
            assert result["races"], rank
    if drop == ("history",):  # the broadcast into the buffer does not wait for the reads of what it was
        read = "copy reads" if not adopts else "attention reads"
        assert any(read in race for race in results[1]["races"]), results[1]["races"][:3]


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "negative-control-overlap"])
def test_without_overlap_each_chunk_issued_ahead_completes_inside_its_issue(overlap):
    """``overlap=False`` (the benchmarks' baseline) makes the same calls with the same bytes, every chunk but the
    first issued ahead as with overlap, but each completes before its issuing call returns: attention never
    reads while a chunk moves. With overlap (the control) the next chunk is in flight at every read but the last."""
    results = launch(prefetch_ranks, 2, True, (), 0, True, overlap, timeout_s=60)
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("error")
        assert result["wrong"] == [] and result["races"] == [] and result["prefetched"] == 4 * 3 - 1, (rank, result)
        assert result["unordered"] == ([1] * (4 * 3 - 1) + [0] if overlap else [0] * (4 * 3)), result["unordered"]


def test_a_chunk_in_flight_that_is_not_the_calls_is_refused_and_breaks_the_runtime():
    """The negative control of the key: a plan whose ahead chunk names other arguments than its call."""
    results = launch(prefetch_ranks, 2, True, None, 2, True, timeout_s=60)
    for result in results:
        assert result["error"].startswith("ContextStreamError: layer 0: the history chunk issued ahead (layer 0"), \
            result["error"]
        assert result["broken"] and result["prefetched"] == 0


def raised_with_a_chunk_in_flight_ranks(rank: int, world: int):
    rt = toy_runtime(kvpp_group(world), 4)
    write_owned(rt, 1)
    workspace = torch.full(pattern(1, 0)[:WORKSPACE_BLOCKS].shape, -1.0)

    def attend(layer, view):
        chunks = ToyChunks(rt, layer, workspace, None)
        chunks.index = 0
        rt.open_turn.stream_history(chunks.rows(workspace, 0), chunks.gather(workspace, layer, 0), chunks)
        raise RuntimeError("the layer's attention failed")  # chunk 1 is in flight

    out = {}
    try:
        with rt.forward(has_history=False, history_ahead=True):
            run_layers(rt, attend)
    except RuntimeError as exc:
        out["raised"] = str(exc)
    out["in_flight"] = rt.parts.context_rows.in_flight is not None
    out["broken"] = f"{type(rt.broken).__name__}: {rt.broken}" if rt.broken is not None else None
    rt.close()
    return out


def test_a_forward_that_raises_with_a_chunk_in_flight_completes_it_and_breaks():
    """A forward that issued only history chunks issued collectives all the same: raised, it completes the
    chunk in flight and breaks the runtime, as after a broadcast."""
    for result in launch(raised_with_a_chunk_in_flight_ranks, 2, timeout_s=60):
        assert result["raised"] == "the layer's attention failed" and not result["in_flight"], result
        assert result["broken"] == "RuntimeError: the layer's attention failed", result


def test_ranks_that_disagree_on_history_ahead_refuse_the_forward_before_anything_moves():
    """Rank 0 would issue each layer's first chunk ahead, rank 1 at its call: a broadcast of the same size
    and source, which would pair with the wrong one. The agreement names the field on both ranks."""
    for out in launch(prefetch_ranks, 2, "rank 0 only", None, timeout_s=60):
        assert out["error"].startswith("BlockSetMismatchError: the ranks disagree on this forward's history "
                                       "ahead;"), out
        assert out["received"] == [] and out["chunks"] == 0 and not out["broken"], out
