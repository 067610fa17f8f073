"""One layer's broadcast from its owner to the KVPP group, issued in program order on a side stream.

Protocol (DESIGN.md, "Runtime"), on every rank of the group, the owner included, once per target layer:

  issue (at ``prefetch``, on the forward's own thread):
    1. record ``ready[slot]`` on the compute stream;
    2. the transfer stream waits on ``ready[slot]``;
    3. under the transfer stream: ``pack`` (the owner's gather of packed blocks into the front of its own
       slot for the layer, if any), then ``dist.broadcast(payload, src=owner, async_op=True)`` for each
       payload (one per bundle component when blocks are packed); return at once.
  complete (at ``wait``):
    4. under the transfer stream, wait for the works (bounded by the timeout where the host waits), then
       ``arrived`` (a receiver's comparison of the ids it received with its own, if any);
    5. record ``done[slot]`` on the transfer stream; the compute stream waits on it.

Invariants. Step 2 orders the broadcast into a slot, and the owner's gather into its own slot, after
every compute-stream access issued before the prefetch: the previous layer that used the slot, and on
the owner the writes into its persistent view. The owner of layer k reads its slot for k only through
that layer's broadcast, never from attention, so the slot is free for the gather on every rank alike. Step 5 orders
every compute-stream access issued after the wait (attention's reads and writes,
the owner's next writes) after the broadcast. No step blocks the host on a device; on CPU the gloo work
runs on gloo's own threads and step 4 is a bounded host wait. Events are reused per slot, so the
per-layer cost allocates nothing. Where streams and events do nothing (`DeviceAPI.orders_streams` is
False: plain CPU), steps 1, 2 and 5 and the stream context are skipped; what remains is the same
program order on the one host thread.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvpp_fx.runtime.collectives import Collectives
from kvpp_fx.runtime.device import DeviceAPI

if TYPE_CHECKING:
    from kvpp_fx.cache.allocate import CacheStorage
    from kvpp_fx.runtime.active_blocks import PackedBlocks
    from kvpp_fx.runtime.layer_place import LayerPlace

logger = logging.getLogger(__name__)

BROADCAST = "broadcast of layer %d"


@dataclass(frozen=True)
class BroadcastInFlight:
    """A forward's broadcast in flight, built where it is issued: its layer's place, its work handles, its
    bytes, a receiver's check of the ids that arrive (packed blocks), its issue time (timeline only)."""

    place: LayerPlace
    work: Any
    nbytes: int
    arrived: Callable[[], None] | None
    issued_ns: int


class BroadcastTransport:
    """Issues and completes broadcasts for one KVPP group; holds the transfer stream and the events."""

    def __init__(self, group: Any, device_api: DeviceAPI, depth: int, collectives: Collectives) -> None:
        self.group = group
        self.api = device_api
        self.collectives = collectives
        self.orders_streams = device_api.orders_streams
        self.stream = device_api.new_stream()
        self._ready = [device_api.new_event() for _ in range(depth)]
        self._done = [device_api.new_event() for _ in range(depth)]

    def issue_layer(self, place: LayerPlace, active: PackedBlocks | None, storage: CacheStorage,
                    timed: bool) -> BroadcastInFlight | None:
        """Issue `place`'s layer for a forward: the whole layer (no packed blocks), or the forward's packed
        blocks of it; returns the broadcast in flight, None when the step reads no block with history."""
        arrived = None
        if active is None:  # a whole layer: the owner's persistent bundle into the receivers' slot
            work = self.issue(place.layer, place.slot, place.whole, place.src)
            nbytes = place.nbytes
        elif active.count == 0:
            return None
        else:
            ids, payload = active.payloads(storage, place.slot, place.layer)
            if place.owned:
                pack = functools.partial(active.pack, self.api, place.block_views, place.pack_views, ids)
                work = self.issue(place.layer, place.slot, payload, place.src, pack)
            else:
                work = self.issue(place.layer, place.slot, payload, place.src)
                arrived = functools.partial(active.check, ids)
            nbytes = sum(part.numel() for part in payload)
        return BroadcastInFlight(place, work, nbytes, arrived, time.perf_counter_ns() if timed else 0)

    def issue(self, layer: int, slot: int, payload: tuple[torch.Tensor, ...], src: int,
              pack: Callable[[], None] | None = None) -> Any:
        """Steps 1-3; returns the broadcasts' work handles."""
        api = self.api
        if not self.orders_streams:
            return self._broadcast(layer, payload, src, pack)  # streams and events would do nothing
        ready = self._ready[slot]
        ready.record(api.current_stream())  # whatever stream the forward runs on now
        self.stream.wait_event(ready)
        with api.stream(self.stream):
            return self._broadcast(layer, payload, src, pack)

    def complete(self, layer: int, slot: int, works: Any, arrived: Callable[[], None] | None = None) -> None:
        """Steps 4-5: the compute stream waits for the broadcasts. Raises `TransferFailedError` on failure
        (which broke the runtime)."""
        api = self.api
        if not self.orders_streams:
            for work in works:
                self.collectives.complete(work, BROADCAST, layer)
            if arrived is not None:
                arrived()
            return
        done = self._done[slot]
        with api.stream(self.stream):
            for work in works:
                self.collectives.complete(work, BROADCAST, layer)
            if arrived is not None:
                arrived()
            done.record(self.stream)
        api.current_stream().wait_event(done)

    def _broadcast(self, layer: int, payload: tuple[torch.Tensor, ...], src: int,
                   pack: Callable[[], None] | None) -> Any:
        if pack is not None:
            pack()
        try:
            return tuple([self.api.broadcast(tensor, src, self.group) for tensor in payload])
        except Exception as exc:
            raise self.collectives.not_issued(exc, BROADCAST, layer) from exc

    def complete_on_host(self, layer: int, works: Any) -> None:
        """Block the host until the broadcasts completed or the timeout expired (forward end, close)."""
        for work in works:
            self.collectives.complete_on_host(work, BROADCAST, layer)
