"""The one layer resolution of a compile: every registered op of a graph, the spec it matched and the
layer it touches.

Invariant: a compile reads each registered op's layer once (`GraphLayers.read`) and hands that reading
on: the vLLM integration reads it to choose the plan's schedule for the graph, then gives it to the
backend, whose pipeline gives it to the insert pass and the verifier (`PassManager.run(layers=...)`);
a compile that is given none reads it once, before the first pass. The verifier still checks the graph
as it stands: it takes an op's reading only while the op matches the same spec and passes the same
layer argument (no pass changes either), and reads an op a pass added or changed again. A reading is
made under a name->index map; `for_config` re-maps its layer names to the configuration's map without
reading the graph again, and refuses a reading made with other op specs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.fx

from kvpp_fx.passes.pass_config import PassConfig
from kvpp_fx.passes.registry import (
    AttentionOpSpec,
    LayerResolutionError,
    OpMatcher,
    get_arg,
    index_of_name,
    layer_of,
    run_time_layer_input,
)

RUN_TIME_LAYER = -1  # the layer of an op whose layer index is a graph input, known only at run time


@dataclass(frozen=True)
class ResolvedOp:
    """A registered op, the spec it matched, the layer argument its call passes and the layer it names.

    ``source``: the SymInt graph input that names the layer at run time (``layer`` is then
    `RUN_TIME_LAYER` and ``name`` the input's). ``error``: why the layer could not be read (``layer``
    and ``name`` then mean nothing); the insert pass raises it, the verifier reports it."""

    node: torch.fx.Node
    spec: AttentionOpSpec
    argument: Any
    layer: int = RUN_TIME_LAYER
    name: str = ""
    source: torch.fx.Node | None = None
    error: LayerResolutionError | None = None

    @property
    def from_graph_input(self) -> bool:
        """The layer is named by a graph input that is not a run-time index (vLLM's ``LayerName``): Dynamo
        does not guard its value."""
        return isinstance(self.argument, torch.fx.Node) and self.source is None


def read_op(node: torch.fx.Node, spec: AttentionOpSpec, names: Mapping[str, int]) -> ResolvedOp:
    """The layer a registered op touches, under the name->index map `names` (``layers.N`` for a name it
    lacks)."""
    argument = None
    try:
        argument = get_arg(node, spec.layer_arg)
        source = run_time_layer_input(node, spec)
        if source is not None:
            return ResolvedOp(node, spec, argument, RUN_TIME_LAYER, source.name, source)
        layer, name = layer_of(node, spec, names or None)
    except LayerResolutionError as exc:
        return ResolvedOp(node, spec, argument, error=exc)
    return ResolvedOp(node, spec, argument, layer, name)


@dataclass(frozen=True)
class GraphLayers:
    """Every registered op of a graph in graph order, read under ``names`` with the specs ``specs`` (by
    op name, as `OpMatcher.by_name` holds them)."""

    ops: tuple[ResolvedOp, ...]
    names: Mapping[str, int]
    specs: Mapping[str, AttentionOpSpec]
    _by_node: Mapping[torch.fx.Node, ResolvedOp] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", MappingProxyType(dict(self.names)))
        object.__setattr__(self, "_by_node", {op.node: op for op in self.ops})

    @classmethod
    def read(cls, graph: torch.fx.Graph, matcher: OpMatcher, names: Mapping[str, int] | None = None) -> GraphLayers:
        names = names or {}
        ops = []
        for node in graph.nodes:
            spec = matcher(node)
            if spec is not None:
                ops.append(read_op(node, spec, names))
        return cls(tuple(ops), names, dict(matcher.by_name))

    def for_config(self, config: PassConfig) -> GraphLayers:
        """This reading under the configuration's name map (re-mapped names, no graph read); a
        `ValueError` when it was read with other specs than the configuration's."""
        if dict(self.specs) != config.matcher.by_name:
            raise ValueError("these graph layers were read with other attention op specs than the pass "
                             f"configuration's: {sorted(self.specs)} against {sorted(config.matcher.by_name)}.")
        names = config.schedule.names
        if dict(self.names) == dict(names):
            return self
        return GraphLayers(tuple(_renamed(op, names) for op in self.ops), names, self.specs)

    def current(self, node: torch.fx.Node, spec: AttentionOpSpec) -> ResolvedOp:
        """The op's reading, read again only when a pass added the node or changed its spec or its layer
        argument since."""
        op = self._by_node.get(node)
        try:
            unchanged = op is not None and op.spec is spec and get_arg(node, spec.layer_arg) is op.argument
        except LayerResolutionError:
            unchanged = False
        return op if unchanged else read_op(node, spec, self.names)

    def layer_names(self) -> dict[str, int]:
        """Name -> index of every layer the ops name (a run-time index names none); raises the first op's
        error."""
        found = {}
        for op in self.ops:
            if op.error is not None:
                raise op.error
            if op.source is None:
                found[op.name] = op.layer
        return found


def _renamed(op: ResolvedOp, names: Mapping[str, int]) -> ResolvedOp:
    if op.error is not None or op.source is not None or op.spec.layer_kind != "name":
        return op
    try:
        return ResolvedOp(op.node, op.spec, op.argument, index_of_name(op.name, names or None), op.name)
    except LayerResolutionError as exc:
        return ResolvedOp(op.node, op.spec, op.argument, error=exc)
