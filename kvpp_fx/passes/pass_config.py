"""What every KVPP pass reads, fixed when a backend is built, and what the insert pass writes on nodes.

Invariant: a compile's passes read their configuration from one frozen `PassConfig` (the plan's
layer schedule, the attention/cache op specs, where the first prefetch goes), never from module state,
so equal configurations (``==``) rewrite a graph alike. The insert pass writes each registered op's
layer (from the compile's one reading, `kvpp_fx.passes.layers`) with the spec it matched as a
`NodeStamp` in ``node.meta["kvpp"]``; the route and split passes read the stamp. The verifier does
not: it matches with the same `OpMatcher` and checks the graph as it stands.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from kvpp_fx.schedule import LayerSchedule
from kvpp_fx.passes.registry import AttentionOpSpec, OpMatcher, default_specs

FIRST_PREFETCH = ("entry", "at_first_wait")
META_KEY = "kvpp"


@dataclass(frozen=True)
class PassConfig:
    """The configuration of the KVPP passes.

    ``first_prefetch``: where the insert pass puts the plan's first prefetch, after the graph's inputs
    ("entry") or just before the first layer's wait ("at_first_wait", for splitters whose eager pieces
    must each take an input, as vLLM's generated code does). ``specs`` are kept sorted by op, so the
    order they were given in changes nothing (`OpMatcher`'s precedence does not depend on it either).
    """

    schedule: LayerSchedule
    specs: tuple[AttentionOpSpec, ...]
    first_prefetch: str = "entry"
    matcher: OpMatcher = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, LayerSchedule):
            raise TypeError(f"schedule must be a LayerSchedule, got {type(self.schedule).__name__}.")
        if self.first_prefetch not in FIRST_PREFETCH:
            raise ValueError(f"first_prefetch must be one of {FIRST_PREFETCH}, got {self.first_prefetch!r}.")
        specs = tuple(self.specs)
        bad = [s for s in specs if not isinstance(s, AttentionOpSpec)]
        if bad:
            raise TypeError(f"specs must be AttentionOpSpecs, got {bad!r}.")
        matcher = OpMatcher(specs)  # refuses two different specs for one op
        object.__setattr__(self, "specs", tuple(sorted(matcher.by_name.values(), key=lambda s: s.op)))
        object.__setattr__(self, "matcher", matcher)

    @classmethod
    def build(cls, plan_or_schedule: Any, *, specs: Iterable[AttentionOpSpec] | None = None,
              names: Mapping[str, int] | None = None, first_prefetch: str = "entry") -> PassConfig:
        """From a `KVPPPlan` or a `LayerSchedule`; ``specs=None`` takes the default specs as they are now."""
        schedule = LayerSchedule.coerce(plan_or_schedule)
        if names:
            schedule = schedule.with_names(names)
        return cls(schedule, tuple(default_specs() if specs is None else specs), first_prefetch)


@dataclass(frozen=True)
class NodeStamp:
    """What the insert pass wrote on a node: its ``role`` ("prefetch", "wait", "enter", "view", "table"
    or "cache_op", a registered op), its layer and layer name, the slot of a kvpp op, the component of a
    view (the kind of a table), and the spec a registered op matched. In a graph whose layer is a run-time value the
    layer is
    -1 (`layers.RUN_TIME_LAYER`) and the name is the graph input that carries it."""

    role: str
    layer: int
    name: str
    slot: int | None = None
    component: str | None = None
    spec: AttentionOpSpec | None = None


class KVPPPassError(ValueError):
    """The graph cannot be rewritten safely."""


def node_value(node: torch.fx.Node):
    """A node's example value: ``meta["val"]`` (after AOT) or Dynamo's ``meta["example_value"]``."""
    return node.meta.get("val", node.meta.get("example_value"))


def is_kvpp_handle(value: object) -> bool:
    """A KVPP cache handle: a tensor of several elements with no bytes behind it (all strides zero)."""
    return (isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 1
            and all(s == 0 for s in value.stride()))


def stamp(node: torch.fx.Node, value: NodeStamp) -> None:
    node.meta[META_KEY] = value


def stamp_of(node: torch.fx.Node) -> NodeStamp | None:
    value = node.meta.get(META_KEY)
    return value if isinstance(value, NodeStamp) else None


def cache_op_stamp(node: torch.fx.Node) -> NodeStamp | None:
    """The stamp of a registered op (draft layers included), or None."""
    value = stamp_of(node)
    return value if value is not None and value.role == "cache_op" else None
