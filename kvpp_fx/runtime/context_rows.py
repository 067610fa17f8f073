"""Prefill history streamed from its owner: each chunk of rows the owner gathers from its persistent
cache, broadcast into the same buffer on every rank.

An attention backend that reads a prefill row's history in bounded chunks (vLLM's MLA prefill gathers
each chunk of context into a workspace, up-projects it and attends over it) needs no scratch slot for
that history. Inside the layer's turn, the owner gathers the chunk out of its own cache into ``rows``
(``gather``), and one broadcast from the owner fills ``rows`` on every other rank, which gathers
nothing. A chunk moves the history it reads, once per layer: its tokens times the cache's bytes per
token, never whole blocks nor whole layers.

Invariants:
- Every rank streams the same chunks in the same order: the chunks come from the step's metadata, which
  every rank derives from the same scheduler output, and the forward's agreement covers the requests
  (on CPU checked before a turn's first collective, as before owner mode's exchanges; on a device read
  when the forward ends, so that nothing waits for it).
- A gather that raises on the owner breaks its runtime before anything is broadcast; the other ranks'
  broadcast then expires (`TransferTimeoutError`), as a peer that stopped issuing collectives does.
- ``rows`` is one contiguous buffer (`ContextStreamError` otherwise, before anything is issued), of the
  chunk's tokens: the same shape on every rank, since every rank reads the chunk from the same metadata.
- The broadcast runs on the current stream, in program order, on the exchange group (its own
  communicator, so it never queues behind the next layer's prefetch), bounded by the runtime's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvpp_fx.runtime.errors import ContextStreamError

if TYPE_CHECKING:
    from kvpp_fx.runtime.collectives import Collectives
    from kvpp_fx.runtime.device import DeviceAPI
    from kvpp_fx.runtime.stats import TransferStats
    from kvpp_fx.runtime.timeline import Timeline

STREAMED = "prefill history chunk of layer %d"


class ContextRows:
    """A runtime's streaming of prefill history chunks: its device API, collectives and exchange group."""

    __slots__ = ("api", "collectives", "group", "group_size", "stats", "timeline")

    def __init__(self, api: DeviceAPI, collectives: Collectives | None, group: Any, group_size: int,
                 stats: TransferStats, timeline: Timeline | None) -> None:
        self.api = api
        self.collectives = collectives  # None for a group of one: the owner is this rank
        self.group = group
        self.group_size = group_size
        self.stats = stats
        self.timeline = timeline

    def stream(self, route: Any, rows: torch.Tensor, gather: Callable[[], Any]) -> None:
        """Fill ``rows`` with one chunk of the layer's history: ``gather()`` on the owner, which writes it
        into ``rows`` from the owner's cache, then one broadcast from the owner to every rank. ``route`` is
        the layer's `parts.LayerRoute` (not imported: `parts` builds this object)."""
        if not isinstance(rows, torch.Tensor) or not rows.is_contiguous():
            raise ContextStreamError(f"layer {route.layer}: a history chunk streams into one contiguous buffer, got "
                                     f"{type(rows).__name__} {tuple(getattr(rows, 'shape', ()))}.")
        if route.owned:
            try:
                gather()
            except Exception as exc:
                failure = ContextStreamError(f"layer {route.layer}: the owner's gather of a history chunk failed "
                                             f"({type(exc).__name__}: {exc}); the other ranks wait for it in vain.")
                if self.collectives is not None:
                    self.collectives.health.broken_by(failure)
                raise failure from exc
        if self.collectives is None:  # a group of one: nothing moves
            self.stats.record_context(route.position, 0)
            return
        start = time.perf_counter_ns()
        self.collectives.run(lambda: self.api.broadcast(rows, route.src, self.group), STREAMED, route.layer)
        nbytes = rows.numel() * rows.element_size()
        self.stats.record_context(route.position, nbytes)  # as a slot's broadcast: its payload, on every rank
        if self.timeline is not None:
            self.timeline.add(f"history L{route.layer}", "history", start, time.perf_counter_ns(),
                              track="kvpp transfer stream", layer=route.layer, bytes=nbytes, owner=route.src)
