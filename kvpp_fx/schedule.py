"""The layer schedule: the one order every rank follows in every forward, and the kvpp ops' names.

Correctness rests on one invariant: every rank issues the same collectives, in the same order, into
the same slots. `LayerSchedule` is the only code that computes them, from the plan's target layers:

- the k-th target layer in execution order is at position k and uses scratch slot ``k % depth``;
- a forward runs ``prefetch(first)``, then for each target layer ``wait(L)`` and ``prefetch(next)``
  (none after the last): `first`, `at_layer`, `steps`;
- a layer's attention entry (a graph whose layer is a run-time value, or an eager hook) runs the
  first layer's prefetch before the first layer's wait: `entry`;
- draft layers are local: they have no position, no slot and no ops.

The plan produces it (`KVPPPlan.schedule`); the passes and the verifier, the runtime's protocol and
``enter_layer``, the vLLM hooks, the device check and the tests read it. Plain Python: it imports
nothing, so every layer of the package can.

The kvpp ops are named here too (`PREFETCH`, `WAIT`, `ENTER_LAYER` in namespace `NAMESPACE`, with their
schemas), so the graph passes match and build them without importing the runtime that implements them.
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
    _entries: Mapping[int, tuple[ScheduleStep, ...]] = field(init=False, repr=False, compare=False)
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
        # What each layer's attention entry runs, computed once: it runs once per layer and forward.
        object.__setattr__(self, "_entries", MappingProxyType(
            {layer: self._entry_steps(k) for k, layer in enumerate(self.target_layers)}))

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
        k = self.position(layer)
        steps = [ScheduleStep(WAIT, layer, self.slot_at(k))]
        if k + 1 < len(self.target_layers):
            steps.append(ScheduleStep(PREFETCH, self.target_layers[k + 1], self.slot_at(k + 1)))
        return tuple(steps)

    def entry(self, layer: int) -> tuple[ScheduleStep, ...]:
        """What a layer's attention entry runs when nothing else issues the forward's ops: the first
        layer's prefetch before the first layer's, then `at_layer`."""
        try:
            return self._entries[layer]
        except KeyError:
            raise KeyError(f"layer {layer} is not a target layer of this schedule.") from None

    def steps(self) -> tuple[ScheduleStep, ...]:
        """The whole forward."""
        return tuple(step for layer in self.target_layers for step in self._entries[layer])

    def run(self, runtime: Any, layer: int | None = None) -> None:
        """Issue the steps on a runtime: the whole forward, or (with `layer`) what that layer's entry runs."""
        for step in self.steps() if layer is None else self.entry(layer):
            getattr(runtime, step.kind)(step.layer, step.slot)

    def _entry_steps(self, k: int) -> tuple[ScheduleStep, ...]:
        first = (self.first(),) if k == 0 else ()
        return first + self.at_layer(self.target_layers[k])
