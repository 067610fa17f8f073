"""Insert explicit ``kvpp.prefetch`` / ``kvpp.wait`` nodes and rebind each layer's cache operands.

Invariant after the pass, for the target layers L0, L1, ... of the layer table, in execution order:
- ``prefetch(L0, slot(L0))`` follows the graph's placeholders;
- immediately before the first node that touches Lk's cache stands ``wait(Lk, slot(Lk), caches)``,
  then one ``getitem`` per cache operand, then ``prefetch(Lk+1, slot(Lk+1))`` (none after the last);
- every cache operand of Lk's registered ops reads the matching ``getitem`` of that wait (the
  rebinding); the graph's original cache values are read only by the wait;
- draft layers get no nodes. Running the pass again changes nothing.
The layers must first appear in the table's order: ranks that issued broadcasts in a different order
would deadlock or exchange the wrong layers, so any other order is a `LayerOrderError`.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from kvpp_fx.ops import is_kvpp_op
from kvpp_fx.passes.layer_table import LayerTable
from kvpp_fx.passes.registry import AttentionOpSpec, find_spec, get_arg, layer_of, set_arg

logger = logging.getLogger(__name__)

WAIT = torch.ops.kvpp.wait.default
PREFETCH = torch.ops.kvpp.prefetch.default


class KVPPPassError(ValueError):
    """The graph cannot be rewritten safely."""


class LayerOrderError(KVPPPassError):
    """The graph's layers do not appear in the plan's execution order."""


class UnknownGraphLayerError(KVPPPassError):
    """The graph touches a layer that the layer table does not know."""


class CacheOperandError(KVPPPassError):
    """A cache operand cannot be rebound (defined too late, or two tensors for one component)."""


@dataclass(frozen=True)
class LayerNodes:
    layer: int
    name: str
    nodes: tuple[torch.fx.Node, ...]
    specs: tuple[AttentionOpSpec, ...]


@dataclass(frozen=True)
class InsertResult:
    changed: bool
    layers: tuple[int, ...]
    waits: tuple[torch.fx.Node, ...] = field(default=(), repr=False)
    prefetches: tuple[torch.fx.Node, ...] = field(default=(), repr=False)


def _val(node: torch.fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def collect_layers(graph: torch.fx.Graph, table: LayerTable) -> list[LayerNodes]:
    """Cache-touching nodes grouped by target layer, in order of each layer's first node."""
    groups: dict[int, list[tuple[torch.fx.Node, AttentionOpSpec]]] = {}
    names: dict[int, str] = {}
    for node in graph.nodes:
        spec = find_spec(node)
        if spec is None:
            continue
        layer, name = layer_of(node, spec, table.names or None)
        if layer in table.draft_layers:
            continue
        if layer not in table.target_layers:
            raise UnknownGraphLayerError(
                f"{node.format_node()} touches layer {layer} ({name}), which is neither a target nor a "
                f"draft layer of the plan (targets {list(table.target_layers)}).")
        groups.setdefault(layer, []).append((node, spec))
        names.setdefault(layer, name)
    return [LayerNodes(layer, names[layer], tuple(n for n, _ in items), tuple(s for _, s in items))
            for layer, items in groups.items()]


def check_layer_order(found: list[int], table: LayerTable) -> None:
    if found != list(table.target_layers):
        raise LayerOrderError(
            f"the graph's layers appear in the order {found}, but the plan's execution order is "
            f"{list(table.target_layers)}: ranks would issue broadcasts in a different order.")


def insert_kvpp_ops(gm: torch.fx.GraphModule, table: LayerTable) -> InsertResult:
    graph = gm.graph
    if any(n.op == "call_function" and is_kvpp_op(n.target) for n in graph.nodes):
        return InsertResult(changed=False, layers=())
    layers = collect_layers(graph, table)
    if not layers:
        return InsertResult(changed=False, layers=())
    check_layer_order([group.layer for group in layers], table)

    order = {node: i for i, node in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    waits, prefetches = [], []

    anchor = placeholders[-1] if placeholders else None
    first = layers[0]
    if anchor is None:
        with graph.inserting_before(next(iter(graph.nodes))):
            prefetches.append(_prefetch(graph, first.layer, first.name, table))
    else:
        with graph.inserting_after(anchor):
            prefetches.append(_prefetch(graph, first.layer, first.name, table))

    for k, group in enumerate(layers):
        operands = _cache_operands(group, order)
        slot = table.slot(group.layer)
        with graph.inserting_before(group.nodes[0]):
            wait = graph.create_node("call_function", WAIT, (group.layer, slot, [node for node, _ in operands],
                                     [component for _, component in operands]), name=f"kvpp_wait_L{group.layer}")
            wait.meta["val"] = [_val(node) for node, _ in operands]
            wait.meta["kvpp"] = {"layer": group.layer, "name": group.name, "slot": slot, "role": "wait"}
            views = {}
            for i, (node, component) in enumerate(operands):
                view = graph.create_node("call_function", operator.getitem, (wait, i),
                                         name=f"{component}_L{group.layer}")
                view.meta["val"] = _val(node)
                view.meta["kvpp"] = {"layer": group.layer, "name": group.name, "slot": slot, "role": "view",
                                     "component": component}
                views[component] = view
            if k + 1 < len(layers):
                nxt = layers[k + 1]
                prefetches.append(_prefetch(graph, nxt.layer, nxt.name, table))
        waits.append(wait)
        for node, spec in zip(group.nodes, group.specs):
            for operand in spec.cache_operands:
                set_arg(node, operand.arg, views[operand.component])

    graph.lint()
    gm.recompile()
    logger.debug("kvpp insert pass: %d layers rewritten", len(layers))
    return InsertResult(True, tuple(g.layer for g in layers), tuple(waits), tuple(prefetches))


def _prefetch(graph: torch.fx.Graph, layer: int, name: str, table: LayerTable) -> torch.fx.Node:
    node = graph.create_node("call_function", PREFETCH, (layer, table.slot(layer)), name=f"kvpp_prefetch_L{layer}")
    node.meta["val"] = None
    node.meta["kvpp"] = {"layer": layer, "name": name, "slot": table.slot(layer), "role": "prefetch"}
    return node


def _cache_operands(group: LayerNodes, order: dict[torch.fx.Node, int]) -> list[tuple[torch.fx.Node, str]]:
    """The distinct (cache value, component) pairs the layer's ops read, in order of first use."""
    first = order[group.nodes[0]]
    seen: dict[str, torch.fx.Node] = {}
    for node, spec in zip(group.nodes, group.specs):
        for operand in spec.cache_operands:
            value = get_arg(node, operand.arg)
            if not isinstance(value, torch.fx.Node):
                raise CacheOperandError(f"{node.format_node()}: cache operand {operand.arg!r} is not a graph value.")
            if operand.component in seen and seen[operand.component] is not value:
                raise CacheOperandError(
                    f"layer {group.layer} reads two different tensors as its {operand.component!r} cache: "
                    f"{seen[operand.component].name} and {value.name}.")
            if order[value] > first:
                raise CacheOperandError(
                    f"layer {group.layer}'s {operand.component!r} cache ({value.name}) is defined after the "
                    f"layer's first cache-touching node; the wait cannot take it.")
            seen[operand.component] = value
    return [(node, component) for component, node in seen.items()]
