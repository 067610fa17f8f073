"""The order of the kvpp ops within one forward, as a state machine over the plan's `LayerSchedule`
(no torch).

Every rank checks the same rules on the same data, so every rank raises the same named error at the
same op (`kvpp_fx.runtime.errors`):

- a layer must be a target of the plan (`UnknownLayerError`; draft layers are local) and the slot the
  plan's (`SlotMismatchError`);
- at most one prefetch is in flight (`PrefetchPendingError`), and a prefetch never targets the slot of
  the in-flight or of the last awaited layer (`SlotBusyError`): that layer's attention still reads it;
- a prefetch names the plan's next layer: the first target, or the one after the last awaited layer
  (`SkippedLayerError` when it skips ahead, `PrefetchOrderError` when it goes back);
- a wait names the in-flight layer (`WaitMismatchError`);
- a forward awaits every target layer (`ProtocolState.unawaited`, checked when it ends).
"""

from __future__ import annotations

from kvpp_fx.runtime.errors import (
    PrefetchOrderError,
    PrefetchPendingError,
    SkippedLayerError,
    SlotBusyError,
    SlotMismatchError,
    UnknownLayerError,
    WaitMismatchError,
)
from kvpp_fx.schedule import LayerSchedule


def locate(schedule: LayerSchedule, layer: int, slot: int) -> int:
    """The layer's position in the schedule, checked against the slot the graph names (one lookup)."""
    where = schedule.places.get(layer)
    if where is None or where[1] != slot:
        refuse(schedule, layer, slot)
    return where[0]


def position_of(schedule: LayerSchedule, layer: int) -> int:
    """The target layer's position in the schedule; `UnknownLayerError` for any other layer."""
    position = schedule.position_or_none(layer)
    if position is None:
        refuse(schedule, layer, -1)
    return position


def refuse(schedule: LayerSchedule, layer: int, slot: int) -> None:
    """Raise the error for a layer that is not a target, or a slot that is not the layer's."""
    position = schedule.position_or_none(layer)
    if position is None:
        kind = "a local draft layer" if layer in schedule.draft_layers else "not a target layer"
        raise UnknownLayerError(f"layer {layer} is not a broadcast layer of this plan ({kind}; "
                                f"targets: {list(schedule.target_layers)}).")
    raise SlotMismatchError(f"layer {layer} uses slot {schedule.slot_at(position)}, the graph asked "
                            f"for slot {slot}.")


class ProtocolState:
    """Where one forward stands: the only layer the next prefetch may name, the layer in flight, the
    last awaited layer (whose slot its attention still reads)."""

    __slots__ = ("schedule", "next_position", "in_flight", "in_flight_slot", "in_flight_position", "last_awaited",
                 "last_slot")

    def __init__(self, schedule: LayerSchedule) -> None:
        self.schedule = schedule
        self.next_position = 0
        self.in_flight: int | None = None
        self.in_flight_slot = -1
        self.in_flight_position = -1
        self.last_awaited: int | None = None
        self.last_slot = -1

    def prefetch(self, layer: int, slot: int) -> int:
        """Check a prefetch and put the layer in flight; returns its position."""
        busy = self.in_flight
        if busy is not None:
            kind = SlotBusyError if self.in_flight_slot == slot else PrefetchPendingError
            raise kind(f"prefetch of layer {layer} (slot {slot}) while layer {busy} "
                       f"(slot {self.in_flight_slot}) is still pending.")
        if self.last_awaited is not None and self.last_slot == slot:
            raise SlotBusyError(f"prefetch of layer {layer} into slot {slot}, which layer {self.last_awaited}'s "
                                "attention is still reading.")
        position = locate(self.schedule, layer, slot)
        expected = self.next_position
        if position != expected:
            targets = self.schedule.target_layers
            if position > expected:
                raise SkippedLayerError(
                    f"prefetch of layer {layer} skips layers {list(targets[expected:position])}; "
                    "layers must follow the plan's execution order on every rank.")
            raise PrefetchOrderError(f"layer {layer} prefetched after layer {targets[expected - 1]}; layers "
                                     "must follow the plan's execution order on every rank.")
        self.in_flight = layer
        self.in_flight_slot = slot
        self.in_flight_position = position
        return position

    def wait(self, layer: int, slot: int) -> int:
        """Check a wait and take the layer out of flight; returns its position."""
        if layer != self.in_flight or slot != self.in_flight_slot:  # the prefetch checked the pair in flight
            locate(self.schedule, layer, slot)  # an unknown layer or a wrong slot is named first
            expected = "nothing is pending" if self.in_flight is None else f"layer {self.in_flight} is pending"
            raise WaitMismatchError(f"wait for layer {layer}, but {expected}.")
        position = self.in_flight_position
        self.in_flight = None
        self.last_awaited = layer
        self.last_slot = self.in_flight_slot
        self.next_position = position + 1
        return position

    def unawaited(self) -> list[int]:
        """The target layers this forward has not awaited (empty once the forward is complete)."""
        return list(self.schedule.target_layers[self.next_position:])
