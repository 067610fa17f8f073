"""The layer schedule: the one order every rank follows in every forward, and the kvpp ops' names.

Correctness rests on one invariant: every rank issues the same collectives, in the same order, into
the same slots. `LayerSchedule` is the only code that computes them, from the plan's target layers:

- the k-th target layer in execution order is at position k and uses scratch slot ``k % depth``;
- a forward runs ``prefetch(first)``, then for each target layer ``wait(L)`` and ``prefetch(next)``
  (none after the last): `first`, `at_layer`, `steps`;
- the forward's first prefetch is issued at the entry of the plan's first layer, unless it was issued
  already; every other layer is in flight when execution reaches it, prefetched by the layer before:
  `pending_at_entry`, the one first-prefetch rule;
- a layer's attention entry (a graph whose layer is a run-time value, or an eager hook) runs the
  first layer's prefetch before the first layer's wait where that rule says so: `entry`;
- draft layers are local: they have no position, no slot and no ops.

The plan produces it (`KVPPPlan.schedule`); the passes and the verifier, the runtime's protocol and
``enter_layer``, the vLLM hooks, the device check and the tests read it. Plain Python: it imports
nothing, so every layer of the package can.

The kvpp ops are named here too (`PREFETCH`, `WAIT`, `ENTER_LAYER` in namespace `NAMESPACE`, with their
schemas), so the graph passes match and build them without importing the runtime that implements them.
So is the refusal of a full graph (`MSG_GRAPH_MODE`), which the backend and the vLLM integration share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

DEFAULT_DEPTH = 2
# With one slot, layer k+1's broadcast would overwrite the slot layer k's attention is still reading.
MIN_DEPTH = 2

NAMESPACE = "kvpp"
PREFETCH, WAIT, ENTER_LAYER = "prefetch", "wait", "enter_layer"
OP_SCHEMAS = {
    PREFETCH: "prefetch(int layer, int slot) -> ()",
    WAIT: ("wait(int layer, int slot, Tensor[] caches, str[] components, bool routed=False, "
           "Tensor[]? tables=None, str[]? table_kinds=None) -> Tensor[]"),
    ENTER_LAYER: ("enter_layer(SymInt layer, Tensor[] caches, str[] components, Tensor[]? tables=None, "
                  "str[]? table_kinds=None) -> Tensor[]"),
}

# A full graph would capture the cache ops and the schedule's collectives: `kvpp_backend(mode="full")` and
# the vLLM integration's deployment check (a FULL cudagraph mode) refuse it with this message.
MSG_GRAPH_MODE = "KVPP supports eager execution or PIECEWISE only."


@dataclass(frozen=True)
class ScheduleStep:
    """One kvpp op of a forward: ``kind`` is `PREFETCH` or `WAIT`."""

    kind: str
    layer: int
    slot: int


@dataclass(frozen=True)
class LayerSchedule:
    """Target layers in execution order (each gets a wait and a prefetch), local drafts (none), the
    scratch depth, and what the graph passes need besides: ``names`` maps layer names (vLLM's
    ``model.layers.N.self_attn.attn``) to indices for ops that identify their layer by name;
    ``components`` gives each target layer's cache component names (its bundle; empty: the verifier
    accepts the components the registered specs declare)."""

    target_layers: tuple[int, ...]
    draft_layers: tuple[int, ...] = ()
    depth: int = DEFAULT_DEPTH
    names: Mapping[str, int] = field(default_factory=dict)
    components: Mapping[int, frozenset[str]] = field(default_factory=dict)
    _position: Mapping[int, int] = field(init=False, repr=False, compare=False)
    _at_layers: Mapping[int, tuple[ScheduleStep, ...]] = field(init=False, repr=False, compare=False)
    places: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)  # layer -> (position, slot)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(self.target_layers))
        object.__setattr__(self, "draft_layers", tuple(self.draft_layers))
        object.__setattr__(self, "names", MappingProxyType(dict(self.names)))
        object.__setattr__(self, "components",
                           MappingProxyType({int(k): frozenset(v) for k, v in dict(self.components).items()}))
        if len(set(self.target_layers)) != len(self.target_layers):
            raise ValueError(f"target layers must be unique, got {list(self.target_layers)}.")
        if set(self.target_layers) & set(self.draft_layers):
            raise ValueError("a layer cannot be both a target and a draft layer.")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < MIN_DEPTH:
            raise ValueError(f"scratch depth must be at least {MIN_DEPTH}, got {self.depth!r}.")
        object.__setattr__(self, "_position", MappingProxyType(
            {layer: k for k, layer in enumerate(self.target_layers)}))
        object.__setattr__(self, "places",
                           {layer: (k, self.slot_at(k)) for k, layer in enumerate(self.target_layers)})
        # What each layer's wait runs, computed once: an entry reads it once per layer and forward.
        object.__setattr__(self, "_at_layers", MappingProxyType(
            {layer: self._at_position(k) for k, layer in enumerate(self.target_layers)}))

    @classmethod
    def from_plan(cls, plan: Any, names: Mapping[str, int] | None = None) -> LayerSchedule:
        """From a `KVPPPlan`: its broadcast layers, its local drafts, its depth and its bundles."""
        components = {}
        spec = getattr(plan, "spec", None)
        if spec is not None:
            components = {layer.index: frozenset(c.name for c in layer.components) for layer in spec.layers
                          if layer.index in plan.target_layers}
        return cls(plan.target_layers, plan.local_draft_layers, plan.depth, names or {}, components)

    @classmethod
    def coerce(cls, value: Any) -> LayerSchedule:
        """A schedule as it is, or a plan's."""
        if isinstance(value, LayerSchedule):
            return value
        schedule = getattr(value, "schedule", None)
        if callable(schedule):
            return schedule()
        if hasattr(value, "target_layers") and hasattr(value, "local_draft_layers"):
            return cls.from_plan(value)
        raise TypeError(f"expected a KVPPPlan or a LayerSchedule, got {type(value).__name__}.")

    def with_names(self, names: Mapping[str, int]) -> LayerSchedule:
        return LayerSchedule(self.target_layers, self.draft_layers, self.depth, names, self.components)

    # --- where a layer stands ------------------------------------------------------------------------

    def is_target(self, layer: int) -> bool:
        return layer in self._position

    def position(self, layer: int) -> int:
        """The layer's place in the broadcast order (KeyError for a layer that is not a target)."""
        try:
            return self._position[layer]
        except KeyError:
            raise KeyError(f"layer {layer} is not a target layer of this schedule.") from None

    def position_or_none(self, layer: int) -> int | None:
        return self._position.get(layer)

    def slot_at(self, position: int) -> int:
        return position % self.depth

    def slot(self, layer: int) -> int:
        """The scratch slot a non-owner reads the layer from."""
        return self.slot_at(self.position(layer))

    def next(self, layer: int) -> int | None:
        """The target layer after `layer` in execution order (None after the last)."""
        k = self.position(layer) + 1
        return self.target_layers[k] if k < len(self.target_layers) else None

    # --- what runs -----------------------------------------------------------------------------------

    def first(self) -> ScheduleStep | None:
        """The prefetch at the start of the forward (None without target layers)."""
        return ScheduleStep(PREFETCH, self.target_layers[0], 0) if self.target_layers else None

    def at_layer(self, layer: int) -> tuple[ScheduleStep, ...]:
        """What runs just before the layer's first cache op: its wait, then the next layer's prefetch."""
        try:
            return self._at_layers[layer]
        except KeyError:
            raise KeyError(f"layer {layer} is not a target layer of this schedule.") from None

    def pending_at_entry(self, layer: int, *, first_issued: bool = False) -> bool:
        """Whether `layer`'s prefetch is already in flight when execution reaches the layer (a graph that
        starts with it, or its attention entry): every layer but the plan's first was prefetched by the
        layer before it (`at_layer`); the first is in flight only when the forward's first prefetch was
        issued already (`first_issued`). Where this is False, the layer's entry issues `first()`. The one
        first-prefetch rule: the insert pass places the first prefetch by it, the verifier starts a graph
        with its first layer outstanding by it, and `entry` (the runtime's) follows it."""
        return first_issued or self.position(layer) > 0

    def entry(self, layer: int, *, first_issued: bool = False) -> tuple[ScheduleStep, ...]:
        """What a layer's attention entry runs when nothing else issues the forward's ops: the plan's
        first prefetch where `pending_at_entry` says it is not in flight, then `at_layer`."""
        at_layer = self.at_layer(layer)
        return at_layer if self.pending_at_entry(layer, first_issued=first_issued) else (self.first(), *at_layer)

    def steps(self) -> tuple[ScheduleStep, ...]:
        """The whole forward."""
        return tuple(step for layer in self.target_layers for step in self.entry(layer))

    def run(self, runtime: Any, layer: int | None = None) -> None:
        """Issue the steps on a runtime: the whole forward, or (with `layer`) what that layer's entry runs."""
        for step in self.steps() if layer is None else self.entry(layer):
            getattr(runtime, step.kind)(step.layer, step.slot)

    def _at_position(self, k: int) -> tuple[ScheduleStep, ...]:
        steps = [ScheduleStep(WAIT, self.target_layers[k], self.slot_at(k))]
        if k + 1 < len(self.target_layers):
            steps.append(ScheduleStep(PREFETCH, self.target_layers[k + 1], self.slot_at(k + 1)))
        return tuple(steps)
