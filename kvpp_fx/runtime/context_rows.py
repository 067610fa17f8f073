"""Prefill history streamed from its owner: each chunk of rows the owner gathers from its persistent
cache, broadcast into the same buffer on every rank, the next chunk in flight while this one computes.

An attention backend that reads a prefill row's history in bounded chunks (vLLM's MLA prefill gathers
each chunk of context into a workspace, up-projects it and attends over it) needs no scratch slot for
that history. Inside the layer's turn, the owner gathers the chunk out of its own cache into ``rows``
(``gather``), and one broadcast from the owner fills ``rows`` on every other rank, which gathers
nothing. A chunk moves the history it reads, once per layer: its tokens times the cache's bytes per
token, never whole blocks nor whole layers.

Prefetched (`ChunkPlan`, from the caller): once a chunk is in ``rows``, the next one is issued into a
buffer shaped like the caller's workspace (its owner gathers it there, one broadcast on a side stream),
so it moves while this chunk computes: the layer's next chunk, or after its last, the first chunk of the
next target layer when the forward allows it (``history_ahead``: no streamed row's history is written by
the step, which that layer's owner has not yet written when the current layer computes). The caller's
call for that chunk then finds it in flight and completes it: the workspace reads the buffer's bytes from
then on and its former bytes, whose chunk was read before this call, become the buffer
(`ChunkPlan.adopt`: two workspaces in turn, nothing copied); where the plan cannot adopt, the chunk is
copied into its ``rows``. One chunk in flight, not two: two (a third workspace) cut the calls' waits on two
gloo ranks by 1-2 ms a forward of 64 chunks, but the launches then competed with a transfer for the host's
cores and the forward was no faster (`benchmarks/history_overlap.py`); and vLLM packs a step's histories
into chunks of its workspace (64K tokens for a long-context model), so histories up to that total are one
chunk per layer, whose next is the next layer's first.

Invariants:
- Every rank streams the same chunks in the same order: the chunks come from the step's metadata, which
  every rank derives from the same scheduler output, and the forward's agreement covers the requests
  (on CPU checked before a turn's first collective, as before owner mode's exchanges; on a device read
  when the forward ends, so that nothing waits for it). Every rank issues the same prefetches: whether a
  chunk follows is a fact of that metadata and of the forward.
- A prefetched chunk is used only by the call whose arguments, its destination aside, equal those it
  was gathered with (`ChunkPlan.key`), same layer, same rows: otherwise `ContextStreamError`, after the
  chunk completed, and the runtime breaks (a rank's key may differ from a peer's).
- A gather that raises on the owner breaks its runtime before anything is broadcast; the other ranks'
  broadcast then expires (`TransferTimeoutError`), as a peer that stopped issuing collectives does.
- ``rows`` is one contiguous buffer (`ContextStreamError` otherwise, before anything is issued), of the
  chunk's tokens: the same shape on every rank, since every rank reads the chunk from the same metadata.
- Device order, as a slot's prefetch (`transport`): the owner's gather and the copy out of the buffer run
  on the compute stream; ``ready`` recorded after both orders the side stream's broadcast into the buffer
  after them, and ``done`` orders the copy after the broadcast. Without prefetch the broadcast runs on the
  current stream. Every broadcast is on the exchange group, bounded by the runtime's timeout; a forward
  that ends with a chunk in flight completes it (`finish`).
- Without overlap (the runtime's ``overlap=False``, a baseline for benchmarks) a chunk issued ahead completes
  inside its issue: the same calls, bytes and order, nothing moving while a chunk computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvpp_fx.runtime.errors import ContextStreamError

if TYPE_CHECKING:
    from kvpp_fx.runtime.collectives import Collectives
    from kvpp_fx.runtime.device import DeviceAPI
    from kvpp_fx.runtime.layer_place import LayerPlace
    from kvpp_fx.runtime.stats import TransferStats
    from kvpp_fx.runtime.timeline import Timeline

STREAMED = "prefill history chunk of layer %d"


@dataclass(frozen=True)
class AheadChunk:
    """A chunk to issue ahead of its call: its layer, what its call must pass (`ChunkPlan.key`), the rows
    it fills in the prefetch buffer and, on the layer's owner, the gather that fills them."""

    layer: int
    key: tuple
    rows: torch.Tensor
    gather: Callable[[], Any]


class ChunkPlan(Protocol):
    """The caller's chunks, as the runtime prefetches them (vLLM's: `context_stream.ChunkStream`)."""

    workspace: torch.Tensor  # what a chunk's rows are cut from; the prefetch buffer is shaped like it

    def key(self) -> tuple:
        """The current call's arguments but its destination, comparable across calls."""

    def ahead(self, buffer: torch.Tensor, next_layer: int | None) -> AheadChunk | None:
        """The chunk after the current one, its rows in `buffer`: the call's next chunk, else the first
        chunk of `next_layer` (None: not this forward), else None."""

    def adopt(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """Make the workspace read `buffer`'s bytes (shaped like it) from now on; return a tensor over its
        former bytes, or None where it cannot (the chunk is then copied)."""


@dataclass
class InFlight:
    """The chunk issued ahead (at most one): its layer's place, its chunk, its work and its issue time."""

    place: LayerPlace
    chunk: AheadChunk
    work: Any
    issued_ns: int
    completed_ns: int = 0  # when it completed inside its issue (no overlap), else 0


class ContextRows:
    """A runtime's streaming of prefill history chunks: its device API, collectives and exchange group,
    the side stream and buffer of the chunk in flight."""

    def __init__(self, api: DeviceAPI, collectives: Collectives | None, group: Any, group_size: int,
                 stats: TransferStats, timeline: Timeline | None, overlap: bool = True) -> None:
        self.api = api
        self.collectives = collectives  # None for a group of one: the owner is this rank
        self.group = group
        self.group_size = group_size
        self.stats = stats
        self.timeline = timeline
        self.overlap = overlap
        self.orders_streams = api.orders_streams
        self.side_stream = api.new_stream() if collectives is not None and api.orders_streams else None
        self._ready = api.new_event() if self.side_stream is not None else None
        self._done = api.new_event() if self.side_stream is not None else None
        self.buffer: torch.Tensor | None = None  # shaped like the last workspace seen; allocated once
        self.in_flight: InFlight | None = None
        self.issued = 0  # broadcasts issued, ever (a forward that issued any breaks the runtime if it raises)

    def stream(self, place: LayerPlace, rows: torch.Tensor, gather: Callable[[], Any],
               plan: ChunkPlan | None = None, next_place: LayerPlace | None = None) -> None:
        """Fill ``rows`` with one chunk of the layer's history: from the chunk in flight if it is this
        call's, else ``gather()`` on the owner and one broadcast from it; then issue the next chunk
        (`plan`), of this layer or of `next_place`'s."""
        if not isinstance(rows, torch.Tensor) or not rows.is_contiguous():
            raise ContextStreamError(f"layer {place.layer}: a history chunk streams into one contiguous buffer, got "
                                     f"{type(rows).__name__} {tuple(getattr(rows, 'shape', ()))}.")
        if self.collectives is None:  # a group of one: the owner gathers, nothing moves
            self._gather(place, gather)
            self.stats.record_context(place.position, 0)
            return
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            self._gather(place, gather)
            start = time.perf_counter_ns()
            self.issued += 1
            self.collectives.run(lambda: self.api.broadcast(rows, place.src, self.group), STREAMED, place.layer)
            self._record(place, rows, start)
        else:
            self._check(flight, place, rows, plan)
            if not flight.completed_ns:
                self._complete(flight)
            if not self._adopted(flight, rows, plan):
                self.api.copy(rows, flight.chunk.rows)
            self._record(place, rows, flight.issued_ns, ahead=True, end=flight.completed_ns)
        if plan is not None:
            self._issue_ahead(place, plan, next_place)

    def _check(self, flight: InFlight, place: LayerPlace, rows: torch.Tensor, plan: ChunkPlan | None) -> None:
        """The chunk in flight must be this call's; otherwise it completes, and the runtime breaks."""
        chunk = flight.chunk
        if (chunk.layer != place.layer or plan is None or chunk.key != plan.key()
                or chunk.rows.shape != rows.shape or chunk.rows.dtype != rows.dtype):
            if not flight.completed_ns:
                self._complete(flight)
            what = "a call without its chunk plan" if plan is None else f"rows {tuple(rows.shape)}"
            raise self.collectives.health.broken_by(ContextStreamError(
                f"layer {place.layer}: the history chunk issued ahead (layer {chunk.layer}, rows "
                f"{tuple(chunk.rows.shape)}) is not the one this call reads ({what}, other arguments); "
                "its rows would be another chunk's."))

    def _adopted(self, flight: InFlight, rows: torch.Tensor, plan: ChunkPlan) -> bool:
        """Whether the workspace took the buffer's bytes (`ChunkPlan.adopt`), the buffer the workspace's former
        ones: only where the call's rows are the front of the workspace, as the chunk's are of the buffer."""
        if rows.data_ptr() != plan.workspace.data_ptr() or flight.chunk.rows.data_ptr() != self.buffer.data_ptr():
            return False
        former = plan.adopt(self.buffer)
        if former is None:
            return False
        self.buffer = former
        return True

    def _issue_ahead(self, place: LayerPlace, plan: ChunkPlan, next_place: LayerPlace | None) -> None:
        workspace = plan.workspace
        buffer = self.buffer
        if buffer is None or buffer.shape != workspace.shape or buffer.dtype != workspace.dtype \
                or buffer.device != workspace.device:
            buffer = self.buffer = torch.empty_like(workspace)
        chunk = plan.ahead(buffer, next_place.layer if next_place is not None else None)
        if chunk is None:
            return
        target = place if chunk.layer == place.layer else next_place
        if target is None or chunk.layer != target.layer:
            raise ContextStreamError(f"layer {place.layer}: a chunk of layer {chunk.layer} was planned ahead, which "
                                     "is neither this layer nor the next.")
        self._gather(target, chunk.gather)
        start = time.perf_counter_ns()
        api, rows = self.api, chunk.rows
        self.issued += 1
        try:
            if self.side_stream is None:
                work = api.broadcast(rows, target.src, self.group)
            else:
                self._ready.record(api.current_stream())  # after the owner's gather and the last copy out
                self.side_stream.wait_event(self._ready)
                with api.stream(self.side_stream):
                    work = api.broadcast(rows, target.src, self.group)
        except Exception as exc:
            raise self.collectives.not_issued(exc, STREAMED, target.layer) from exc
        flight = InFlight(target, chunk, work, start)
        if not self.overlap:
            self._complete(flight)
            flight.completed_ns = time.perf_counter_ns()
        self.in_flight = flight

    def _complete(self, flight: InFlight) -> None:
        """The compute stream waits for the chunk in flight (on CPU, the host, bounded)."""
        start = time.perf_counter_ns() if self.timeline is not None else 0
        if self.side_stream is None:
            self.collectives.complete(flight.work, STREAMED, flight.place.layer)
        else:
            with self.api.stream(self.side_stream):
                self.collectives.complete(flight.work, STREAMED, flight.place.layer)
                self._done.record(self.side_stream)
            self.api.current_stream().wait_event(self._done)
        if self.timeline is not None:  # what the chunk's call waited for it: the transfer not hidden
            self.timeline.add(f"history wait L{flight.place.layer}", "history wait", start, time.perf_counter_ns(),
                              layer=flight.place.layer)

    def _gather(self, place: LayerPlace, gather: Callable[[], Any]) -> None:
        if not place.owned:
            return
        try:
            gather()
        except Exception as exc:
            failure = ContextStreamError(f"layer {place.layer}: the owner's gather of a history chunk failed "
                                         f"({type(exc).__name__}: {exc}); the other ranks wait for it in vain.")
            if self.collectives is not None:
                self.collectives.health.broken_by(failure)
            raise failure from exc

    def _record(self, place: LayerPlace, rows: torch.Tensor, start: int, ahead: bool = False, end: int = 0) -> None:
        nbytes = rows.numel() * rows.element_size()
        self.stats.record_context(place.position, nbytes, ahead)  # as a slot's broadcast: its payload, on every rank
        if self.timeline is not None:
            self.timeline.add(f"history L{place.layer}", "history", start, end or time.perf_counter_ns(),
                              track="kvpp history stream", layer=place.layer, bytes=nbytes, owner=place.src)

    def finish(self) -> None:
        """A forward ends: a chunk still in flight (its call never came) completes on the host, bounded;
        its failure has broken the runtime."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None and not flight.completed_ns:
            self.collectives.complete_on_host(flight.work, STREAMED, flight.place.layer)
