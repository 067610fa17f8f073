"""`KVPPRuntime`: the object users hold. It owns every cache byte of its rank and serves the ops.

Per forward (``with runtime.forward(has_history): ...``), the graph calls, for target layers in
execution order: ``prefetch(first)``, then ``wait(L)`` followed by ``prefetch(next)``. ``wait`` returns
the view attention must read: persistent on the owner, the layer's scratch slot elsewhere. A forward
without history moves no bytes. Protocol violations raise the named errors of `errors`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvpp_fx.cache.allocate import CacheStorage
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import (
    ForwardClosedError,
    NestedForwardError,
    NoActiveForwardError,
    PrefetchOrderError,
    PrefetchPendingError,
    SkippedLayerError,
    SlotBusyError,
    SlotMismatchError,
    UnknownLayerError,
    WaitMismatchError,
)
from kvpp_fx.runtime.scheduler import PendingPrefetch, PrefetchScheduler
from kvpp_fx.runtime.timeline import Timeline
from kvpp_fx.runtime.transport import BroadcastTransport

logger = logging.getLogger(__name__)

_CURRENT: contextvars.ContextVar[KVPPRuntime | None] = contextvars.ContextVar("kvpp_runtime", default=None)


def active_runtime() -> KVPPRuntime | None:
    """The runtime of the enclosing ``runtime.forward(...)``, or None outside one."""
    return _CURRENT.get()


def current_runtime() -> KVPPRuntime:
    runtime = _CURRENT.get()
    if runtime is None:
        raise NoActiveForwardError(
            "kvpp.prefetch/kvpp.wait ran outside `with runtime.forward(has_history):`."
        )
    return runtime


@dataclass
class _Forward:
    has_history: bool
    pending: PendingPrefetch | None = None
    last_position: int = -1  # position in plan.target_layers of the last prefetch
    awaited: list[int] = field(default_factory=list)
    failure: BaseException | None = None


class KVPPRuntime:
    def __init__(self, plan: KVPPPlan, storage: CacheStorage, group: Any, rank: int, device_api: DeviceAPI,
                 transport: BroadcastTransport, timeline: Timeline | None, overlap: bool = True) -> None:
        self.plan = plan
        self.storage = storage
        self.group = group
        self.rank = rank
        self.api = device_api
        self.transport = transport
        self.timeline = timeline
        self.scheduler = PrefetchScheduler(transport, device_api, timeline)
        self.overlap = overlap
        self._forward: _Forward | None = None
        self._required = tuple(i for i in plan.target_layers if i not in plan.spec.draft_layers)
        self._closed = False

    @classmethod
    def create(cls, plan: KVPPPlan, storage: CacheStorage, group: Any = None, *,
               delay: Callable[[int], float] | None = None, timeline: Timeline | None = None,
               overlap: bool = True) -> KVPPRuntime:
        """`group` is this rank's KVPP process group (None only for a group of one).

        ``overlap=False`` completes each broadcast inside its prefetch: the same bytes move, nothing
        hides behind compute (a baseline for benchmarks and a debugging aid).
        """
        if group is None:
            if plan.group_size != 1:
                raise ValueError(f"a KVPP group of size {plan.group_size} needs a process group.")
            rank = 0
        else:
            if dist.get_world_size(group) != plan.group_size:
                raise ValueError(f"the process group has {dist.get_world_size(group)} ranks, "
                                 f"the plan {plan.group_size}.")
            rank = dist.get_rank(group)
        if storage.rank != rank or storage.plan is not plan:
            raise ValueError(f"storage was allocated for rank {storage.rank} of another plan, "
                             f"this is rank {rank}.")
        api = DeviceAPI(storage.device)
        transport = BroadcastTransport(group, api, delay=delay, timeline=timeline)
        return cls(plan, storage, group, rank, api, transport, timeline, overlap)

    # --- views ------------------------------------------------------------------------------------

    def view(self, layer: int) -> torch.Tensor:
        return self.storage.byte_view(layer)

    def typed_views(self, layer: int) -> dict[str, torch.Tensor]:
        return self.storage.typed_views(layer)

    def handles(self, layer: int) -> dict[str, torch.Tensor]:
        """What a compiled model takes as the layer's caches; see `CacheStorage.handles`."""
        return self.storage.handles(layer)

    # --- the forward context ------------------------------------------------------------------------

    @contextlib.contextmanager
    def forward(self, has_history: bool) -> Iterator[KVPPRuntime]:
        if self._closed:
            raise KVPPRuntimeClosed("this KVPPRuntime was closed.")
        if self._forward is not None:
            raise NestedForwardError("runtime.forward() is already open.")
        state = _Forward(has_history=bool(has_history) and self.plan.enabled)
        self._forward = state
        self.transport.counters.begin_forward(state.has_history)
        token = _CURRENT.set(self)
        ok = False
        try:
            yield self
            ok = True
        finally:
            _CURRENT.reset(token)
            self._forward = None
            self._finish(state, ok)

    def _finish(self, state: _Forward, ok: bool) -> None:
        pending = state.pending
        if pending is not None:
            self.scheduler.drain(pending, lambda exc: logger.warning(
                "KVPP broadcast of layer %d failed while the forward ended: %s", pending.layer, exc))
        if not ok or state.failure is not None:
            return
        skipped = [i for i in self._required if i not in state.awaited]
        if skipped:
            raise SkippedLayerError(
                f"the forward ended without awaiting layers {skipped}; every target layer must be awaited "
                "once per forward.")

    def _active(self) -> _Forward:
        state = self._forward
        if state is None or _CURRENT.get() is not self:
            raise NoActiveForwardError("kvpp ops ran outside `with runtime.forward(has_history):`.")
        if state.failure is not None:
            raise ForwardClosedError(f"this forward was closed by an earlier failure: {state.failure}")
        return state

    def _check_layer(self, layer: int, slot: int) -> int:
        if layer not in self.plan.target_layers:
            raise UnknownLayerError(f"layer {layer} is not a broadcast layer of this plan "
                                    f"(targets: {list(self.plan.target_layers)}).")
        if slot != self.plan.slot(layer):
            raise SlotMismatchError(f"layer {layer} uses slot {self.plan.slot(layer)}, the graph asked "
                                    f"for slot {slot}.")
        return self.plan.target_layers.index(layer)

    # --- the two ops ------------------------------------------------------------------------------

    def prefetch(self, layer: int, slot: int) -> None:
        state = self._active()
        position = self._check_layer(layer, slot)
        if state.pending is not None:
            kind = SlotBusyError if state.pending.slot == slot else PrefetchPendingError
            raise kind(f"prefetch of layer {layer} (slot {slot}) while layer {state.pending.layer} "
                       f"(slot {state.pending.slot}) is still pending.")
        if position <= state.last_position:
            raise PrefetchOrderError(
                f"layer {layer} prefetched after layer {self.plan.target_layers[state.last_position]}; "
                "layers must follow the plan's execution order on every rank.")
        state.last_position = position
        state.pending = self.scheduler.submit(layer, slot, self.view(layer), self.plan.owners[layer],
                                              communicate=state.has_history)
        if not self.overlap:
            try:
                self.scheduler.complete(state.pending)
            except Exception as exc:
                state.failure = exc
                raise
            state.pending.future = None

    def wait(self, layer: int, slot: int) -> torch.Tensor:
        state = self._active()
        self._check_layer(layer, slot)
        pending = state.pending
        if pending is None or pending.layer != layer:
            expected = "nothing is pending" if pending is None else f"layer {pending.layer} is pending"
            raise WaitMismatchError(f"wait for layer {layer}, but {expected}.")
        state.pending = None
        try:
            self.scheduler.complete(pending)
        except Exception as exc:
            state.failure = exc
            raise
        state.awaited.append(layer)
        return self.view(layer)

    # --- counters and lifetime ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out = self.transport.counters.snapshot()
        out.update(rank=self.rank, allocated_bytes=self.storage.allocated_bytes,
                   persistent_layers=list(self.storage.persistent_layers),
                   scratch_buffers=len(self.storage.scratch))
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.scheduler.close()

    def __enter__(self) -> KVPPRuntime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class KVPPRuntimeClosed(ForwardClosedError):
    """The runtime was closed."""
