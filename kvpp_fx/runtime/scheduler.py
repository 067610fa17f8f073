"""The prefetch scheduler: one transfer thread, at most one layer in flight.

Invariant: a prefetch records ``ready`` on the compute stream *before* its job is queued, so the
broadcast into a scratch slot never starts ahead of compute work issued before the prefetch (on a
device, the previous reader of that slot). Jobs run in submission order on a single worker thread,
so every rank issues its collectives in the same order.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import TransferFailedError
from kvpp_fx.runtime.timeline import Timeline
from kvpp_fx.runtime.transport import BroadcastTransport

logger = logging.getLogger(__name__)


@dataclass
class PendingPrefetch:
    layer: int
    slot: int
    future: concurrent.futures.Future | None  # None: nothing to transfer (no history)


class PrefetchScheduler:
    def __init__(self, transport: BroadcastTransport, device_api: DeviceAPI,
                 timeline: Timeline | None = None) -> None:
        self.transport = transport
        self.api = device_api
        self.timeline = timeline
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpp-transfer")

    def submit(self, layer: int, slot: int, view: torch.Tensor, owner_in_group: int,
               communicate: bool) -> PendingPrefetch:
        start = time.perf_counter_ns()
        future = None
        if communicate:
            ready = self.api.record_event()
            future = self._executor.submit(self.transport.broadcast, layer, view, owner_in_group, ready)
        if self.timeline is not None:
            self.timeline.add(f"prefetch L{layer}", "prefetch", start, time.perf_counter_ns(),
                              layer=layer, slot=slot, communicate=communicate)
        return PendingPrefetch(layer, slot, future)

    def complete(self, pending: PendingPrefetch) -> None:
        """Block until the pending broadcast has landed; re-raise its failure here."""
        if pending.future is None:
            return
        start = time.perf_counter_ns()
        try:
            pending.future.result()
        except Exception as exc:
            raise TransferFailedError(f"broadcast of layer {pending.layer} failed: {exc}") from exc
        finally:
            if self.timeline is not None:
                self.timeline.add(f"wait L{pending.layer}", "wait", start, time.perf_counter_ns(),
                                  layer=pending.layer)

    def drain(self, pending: PendingPrefetch, on_error: Callable[[BaseException], None]) -> None:
        """Cancel a queued broadcast, or let a running one finish, so nothing outlives the forward."""
        if pending.future is None or pending.future.cancel():
            return
        try:
            pending.future.result()
        except Exception as exc:  # reported, not raised: the forward is already ending
            on_error(exc)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
