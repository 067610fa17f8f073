"""What the passes need to know about the layers: broadcast order, drafts, scratch depth, names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvpp_fx.cache.placement import MIN_DEPTH


@dataclass(frozen=True)
class LayerTable:
    """Target layers in execution order (each gets wait/prefetch nodes), drafts (none), slot depth.

    ``names`` maps layer names (vLLM's ``model.layers.N.self_attn.attn``) to indices for ops that
    identify their layer by name.
    """

    target_layers: tuple[int, ...]
    draft_layers: tuple[int, ...] = ()
    depth: int = 2
    names: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(self.target_layers))
        object.__setattr__(self, "draft_layers", tuple(self.draft_layers))
        object.__setattr__(self, "names", MappingProxyType(dict(self.names)))
        if len(set(self.target_layers)) != len(self.target_layers):
            raise ValueError(f"target layers must be unique, got {list(self.target_layers)}.")
        if set(self.target_layers) & set(self.draft_layers):
            raise ValueError("a layer cannot be both a target and a draft layer.")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < MIN_DEPTH:
            raise ValueError(f"scratch depth must be at least {MIN_DEPTH}, got {self.depth!r}.")

    @classmethod
    def from_plan(cls, plan: Any, names: Mapping[str, int] | None = None) -> LayerTable:
        """From a `KVPPPlan`: its broadcast layers, its local drafts and its depth."""
        return cls(plan.target_layers, plan.local_draft_layers, plan.depth, names or {})

    @classmethod
    def coerce(cls, value: Any) -> LayerTable:
        if isinstance(value, LayerTable):
            return value
        if hasattr(value, "target_layers") and hasattr(value, "local_draft_layers"):
            return cls.from_plan(value)
        raise TypeError(f"expected a KVPPPlan or a LayerTable, got {type(value).__name__}.")

    def slot(self, layer: int) -> int:
        return self.target_layers.index(layer) % self.depth
