"""Whole-layer broadcast of one layer's bundle from its owner to the KVPP group, on a side stream.

Protocol (DESIGN.md, "Runtime"), for every rank, the owner included, once per target layer in
execution order:
  1. the transfer stream waits on the ``ready`` event recorded on the compute stream at prefetch;
  2. ``dist.broadcast(view, src=<owner's global rank>, group=<kvpp group>, async_op=True)``;
  3. ``work.wait()``;
  4. record ``done`` on the transfer stream and synchronize it.
Step 4 returns only when the bytes have landed, so the owner's persistent view is never rewritten by
the next step's attention while the broadcast still reads it.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.timeline import Timeline

logger = logging.getLogger(__name__)

DELAY_ENV = "KVPP_TRANSPORT_DELAY_MS"


def delay_from_env(value: str | None = None) -> Callable[[int], float] | None:
    """Parse ``KVPP_TRANSPORT_DELAY_MS``: "5" (fixed) or "0-20" (uniform random), in milliseconds.

    A test hook: the delay is slept on the transfer thread before each broadcast.
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
class TransferCounters:
    """Broadcast counts and bytes, in total, per layer and per forward."""

    broadcasts: int = 0
    bytes: int = 0
    per_layer: dict[int, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    forwards: list[dict[str, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin_forward(self, has_history: bool) -> None:
        with self._lock:
            self.forwards.append({"has_history": has_history, "broadcasts": 0, "bytes": 0, "layers": []})

    def record(self, layer: int, nbytes: int) -> None:
        with self._lock:
            self.broadcasts += 1
            self.bytes += nbytes
            self.per_layer[layer][0] += 1
            self.per_layer[layer][1] += nbytes
            if self.forwards:
                current = self.forwards[-1]
                current["broadcasts"] += 1
                current["bytes"] += nbytes
                current["layers"].append(layer)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "broadcasts": self.broadcasts,
                "bytes": self.bytes,
                "per_layer": {layer: {"broadcasts": c, "bytes": b} for layer, (c, b) in sorted(self.per_layer.items())},
                "forwards": [dict(f, layers=list(f["layers"])) for f in self.forwards],
            }


class BroadcastTransport:
    """Carries out the broadcast protocol for one KVPP group."""

    def __init__(self, group: Any, device_api: DeviceAPI, *, delay: Callable[[int], float] | None = None,
                 timeline: Timeline | None = None) -> None:
        self.group = group
        self.api = device_api
        self.stream = device_api.new_stream()
        self.delay = delay if delay is not None else delay_from_env()
        self.timeline = timeline
        self.counters = TransferCounters()

    def broadcast(self, layer: int, view: torch.Tensor, owner_in_group: int, ready: Any) -> None:
        start = time.perf_counter_ns()
        self.stream.wait_event(ready)
        if self.delay is not None:
            time.sleep(self.delay(layer))
        src = dist.get_global_rank(self.group, owner_in_group)
        with self.api.stream(self.stream):
            work = dist.broadcast(view, src=src, group=self.group, async_op=True)
            work.wait()
            done = self.api.new_event()
            done.record(self.stream)
        done.synchronize()
        nbytes = view.numel() * view.element_size()
        self.counters.record(layer, nbytes)
        if self.timeline is not None:
            self.timeline.add(f"broadcast L{layer}", "broadcast", start, time.perf_counter_ns(),
                              layer=layer, bytes=nbytes, src=src)
