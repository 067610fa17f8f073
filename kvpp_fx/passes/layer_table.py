"""What the passes need to know about the layers: broadcast order, drafts, scratch depth, names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvpp_fx.cache.placement import MIN_DEPTH, BroadcastSchedule


@dataclass(frozen=True)
class LayerTable:
    """Target layers in execution order (each gets wait/prefetch nodes), drafts (none), slot depth.

    ``names`` maps layer names (vLLM's ``model.layers.N.self_attn.attn``) to indices for ops that
    identify their layer by name. ``components`` gives each layer's cache component names (its
    bundle); when it is empty, the verifier accepts the components the registered specs declare.
    """

    target_layers: tuple[int, ...]
    draft_layers: tuple[int, ...] = ()
    depth: int = 2
    names: Mapping[str, int] = field(default_factory=dict)
    components: Mapping[int, frozenset[str]] = field(default_factory=dict)
    _position: Mapping[int, int] = field(init=False, repr=False, compare=False)

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
        object.__setattr__(self, "_position", {layer: k for k, layer in enumerate(self.target_layers)})

    @classmethod
    def from_plan(cls, plan: Any, names: Mapping[str, int] | None = None) -> LayerTable:
        """From a `KVPPPlan`: its broadcast layers, its local drafts, its depth and its bundles."""
        components = {}
        spec = getattr(plan, "spec", None)
        if spec is not None:
            components = {layer.index: frozenset(c.name for c in layer.components) for layer in spec.layers
                          if layer.index in plan.target_layers}
        return cls(plan.target_layers, plan.local_draft_layers, plan.depth, names or {}, components)

    @classmethod
    def coerce(cls, value: Any) -> LayerTable:
        if isinstance(value, LayerTable):
            return value
        if hasattr(value, "target_layers") and hasattr(value, "local_draft_layers"):
            return cls.from_plan(value)
        raise TypeError(f"expected a KVPPPlan or a LayerTable, got {type(value).__name__}.")

    def with_names(self, names: Mapping[str, int]) -> LayerTable:
        return LayerTable(self.target_layers, self.draft_layers, self.depth, names, self.components)

    def position(self, layer: int) -> int:
        """The layer's place in the broadcast order (KeyError for a layer that is not a target)."""
        return self._position[layer]

    def slot(self, layer: int) -> int:
        return self._position[layer] % self.depth

    def schedule(self) -> BroadcastSchedule:
        """The order of the kvpp ops in every forward (the plan's, `KVPPPlan.schedule`)."""
        return BroadcastSchedule(self.target_layers, self.depth)
