"""One layer's broadcast from its owner to the KVPP group, issued in program order on a side stream.

Protocol (DESIGN.md, "Runtime"), on every rank of the group, the owner included, once per target layer:

  issue (at ``prefetch``, on the forward's own thread):
    1. record ``ready[slot]`` on the compute stream;
    2. the transfer stream waits on ``ready[slot]``;
    3. under the transfer stream: ``pack`` (the owner's gather of active blocks into staging, if any),
       then ``dist.broadcast(payload, src=owner, async_op=True)``; return at once.
  complete (at ``wait``):
    4. under the transfer stream, wait for the work (bounded by the timeout where the host waits), then
       ``unpack`` (a receiver's scatter from staging into the slot, if any);
    5. record ``done[slot]`` on the transfer stream; the compute stream waits on it.

Invariants. Step 2 orders the broadcast into a slot after every compute-stream access issued before
the prefetch: the previous layer that used the slot, and on the owner the writes into its persistent
view. Step 5 orders every compute-stream access issued after the wait (attention's reads and writes,
the owner's next writes) after the broadcast. No step blocks the host on a device; on CPU the gloo work
runs on gloo's own threads and step 4 is a bounded host wait. Events are reused per slot, so the
per-layer cost allocates nothing.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import TransferFailedError, TransferTimeoutError

logger = logging.getLogger(__name__)

DELAY_ENV = "KVPP_TRANSPORT_DELAY_MS"


def delay_from_env(value: str | None = None) -> Callable[[int], float] | None:
    """Parse ``KVPP_TRANSPORT_DELAY_MS``: "5" (fixed) or "0-20" (uniform random), in milliseconds.

    A test hook: the delay is slept on the issuing thread before each broadcast is issued, so ranks
    issue their broadcasts with a skew.
    """
    value = os.environ.get(DELAY_ENV) if value is None else value
    if not value:
        return None
    try:
        if "-" in value:
            low, high = (float(x) / 1000.0 for x in value.split("-", 1))
        else:
            low = high = float(value) / 1000.0
    except ValueError:
        raise ValueError(f"{DELAY_ENV} must be 'MS' or 'LOW-HIGH' in milliseconds, got {value!r}.") from None
    if low < 0 or high < low:
        raise ValueError(f"{DELAY_ENV} must be a non-negative range, got {value!r}.")
    rng = random.Random()
    return lambda layer: rng.uniform(low, high)


@dataclass
class InFlight:
    """A broadcast issued and not yet completed. ``work`` is None once completed."""

    layer: int
    slot: int
    nbytes: int
    work: Any
    issued_ns: int
    unpack: Callable[[], None] | None = None


class BroadcastTransport:
    """Issues and completes broadcasts for one KVPP group; holds the transfer stream and the events."""

    def __init__(self, group: Any, device_api: DeviceAPI, depth: int, timeout: timedelta, *,
                 delay: Callable[[int], float] | None = None) -> None:
        self.group = group
        self.api = device_api
        self.timeout = timeout
        self.delay = delay if delay is not None else delay_from_env()
        self.stream = device_api.new_stream()
        self._ready = [device_api.new_event() for _ in range(depth)]
        self._done = [device_api.new_event() for _ in range(depth)]

    def issue(self, layer: int, slot: int, payload: torch.Tensor, src: int, *,
              pack: Callable[[], None] | None = None, unpack: Callable[[], None] | None = None) -> InFlight:
        if self.delay is not None:
            time.sleep(self.delay(layer))
        ready = self._ready[slot]
        ready.record(self.api.current_stream())  # whatever stream the forward runs on now
        self.stream.wait_event(ready)
        with self.api.stream(self.stream):
            if pack is not None:
                pack()
            try:
                work = self.api.broadcast(payload, src, self.group)
            except Exception as exc:
                raise TransferFailedError(f"broadcast of layer {layer} could not be issued: {exc}") from exc
        return InFlight(layer, slot, payload.numel() * payload.element_size(), work, time.perf_counter_ns(),
                        unpack)

    def complete(self, flight: InFlight) -> None:
        """Make the compute stream wait for the broadcast. Raises `TransferFailedError` on failure."""
        work, flight.work = flight.work, None
        if work is None:
            return
        done = self._done[flight.slot]
        with self.api.stream(self.stream):
            self._wait(f"broadcast of layer {flight.layer}", lambda: self.api.wait_work(work, self.timeout))
            if flight.unpack is not None:
                flight.unpack()
            done.record(self.stream)
        self.api.current_stream().wait_event(done)

    def complete_on_host(self, flight: InFlight) -> None:
        """Block the host until the broadcast completed or the timeout expired (forward exit, close)."""
        work, flight.work = flight.work, None
        if work is not None:
            self._wait(f"broadcast of layer {flight.layer}", lambda: self.api.host_wait_work(work, self.timeout))

    def complete_work(self, work: Any, what: str) -> None:
        """Order the current stream after another collective of the group (the host too, on CPU)."""
        self._wait(what, lambda: self.api.wait_work(work, self.timeout))

    def complete_work_on_host(self, work: Any, what: str) -> None:
        """Block the host until another collective of the group completed, bounded by the timeout."""
        self._wait(what, lambda: self.api.host_wait_work(work, self.timeout))

    def _wait(self, what: str, wait: Callable[[], None]) -> None:
        start = time.monotonic()
        try:
            wait()
        except Exception as exc:
            elapsed = time.monotonic() - start
            if elapsed >= self.timeout.total_seconds() * 0.99 or "timed out" in str(exc).lower():
                raise TransferTimeoutError(
                    f"{what} did not complete within {self.timeout.total_seconds():g}s "
                    f"(a peer died or stopped issuing collectives): {exc}") from exc
            raise TransferFailedError(f"{what} failed: {exc}") from exc
