"""Insert explicit ``kvpp.prefetch`` / ``kvpp.wait`` nodes and rebind each layer's cache operands.

Invariant after the pass, for the run of target layers Li .. Lj that the graph holds (a contiguous,
in-order slice of the plan's target layers; the whole plan when the graph is the whole compiled
function, ``fullgraph=True``):
- every registered op carries a `NodeStamp` with its layer and the spec it matched (draft layers'
  too, on every graph the pass sees, rewritten or not);
- ``prefetch(Li, slot(Li))`` follows the graph's placeholders when Li is the plan's first layer (with
  ``first_prefetch="at_first_wait"``: it stands just before Li's wait, for splitters that need every
  eager piece to take an input, as vLLM's generated code does); otherwise Li is already pending from
  the previous graph and is not prefetched here;
- immediately before the first node that touches Lk's cache stands ``wait(Lk, slot(Lk), caches)``,
  then one ``getitem`` per cache operand, then ``prefetch`` of the plan's next layer (also after Lj,
  whose successor a later graph awaits; none after the plan's last layer);
- every cache operand of Lk's registered ops reads the matching ``getitem`` of that wait (the
  rebinding), and the graph's original cache values are read only by the waits: any other reader (an
  unregistered op, a view, a Python-level use) is refused before anything is changed;
- every registered op of Lk that reads a cache declares its table operands or that it remaps its
  block ids itself (`UnremappedTablesError` otherwise, before anything is changed);
- every table operand (block table, slot mapping) the specs of Lk's ops declare is passed to the wait
  too (``tables=``, ``table_kinds=``), and the op reads the wait's ``getitem`` after the caches' instead:
  the runtime hands back the table a rank must read, remapped where it reads a packed slot. Other
  readers of a table (the model's own arithmetic, a draft layer) keep the original;
- draft layers get no nodes. Running the pass again changes nothing;
- a graph without registered ops is left alone only when graph breaks may have split the model and
  nothing in it names a target layer (no KVPP handle read, no layer name): it cannot read a cache.
  Otherwise the model's attention op is not registered: `NoGraphLayersError`.
A graph whose registered ops take their layer index from a graph input (a SymInt: Dynamo compiled one
frame for several layers) holds one layer known only at run time. All its registered ops read that one
input, and immediately before the first stands ``enter_layer(layer, caches)``, then one ``getitem`` per
cache operand, which the ops read: the runtime runs the plan's schedule for the layer the input names
(docs/graph-contract.md). Such a graph holds no op with a constant layer.
Ranks that issued broadcasts in a different order would deadlock or exchange the wrong layers, so a
run that is not a contiguous slice of the plan in plan order is a `LayerOrderError`. The order of the
kvpp ops is the plan's `LayerSchedule`, computed nowhere else. What the pass refuses, it refuses before
changing anything (`insert_checks`); the layers it rewrites are the compile's one reading (`layers`).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from kvpp_fx import ops
from kvpp_fx.ops import kvpp_nodes
from kvpp_fx.passes.insert_checks import (
    LayerNodes,
    Operands,
    cache_operands,
    check_layer_run,
    group_layers,
    refuse_a_graph_without_layers,
    refuse_shared_caches,
    refuse_stray_readers,
    refuse_undeclared_tables,
    resolved_ops,
    run_time_layer_group,
    table_operands,
)
from kvpp_fx.passes.layers import RUN_TIME_LAYER, GraphLayers, ResolvedOp
from kvpp_fx.passes.pass_config import NodeStamp, PassConfig, node_value, stamp
from kvpp_fx.passes.registry import get_arg, set_arg
from kvpp_fx.schedule import ScheduleStep

logger = logging.getLogger(__name__)

# The graph targets the pass writes: the overloads, as AOT writes them too.
WAIT_OP, PREFETCH_OP, ENTER_LAYER_OP = ops.wait.default, ops.prefetch.default, ops.enter_layer.default


@dataclass(frozen=True)
class InsertResult:
    changed: bool
    layers: tuple[int, ...]
    waits: tuple[torch.fx.Node, ...] = field(default=(), repr=False)
    prefetches: tuple[torch.fx.Node, ...] = field(default=(), repr=False)
    run_time_layer: bool = False  # one layer, named by a graph input at run time (`enter_layer`)


def insert_kvpp_ops(gm: torch.fx.GraphModule, config: PassConfig, *, graph_breaks: bool = False,
                    layers: GraphLayers | None = None) -> InsertResult:
    """Rewrite `gm`'s graph in place (see the module docstring); the caller regenerates ``gm.code``.
    `graph_breaks`: graph breaks may have split the model, so this graph may hold a run of the plan's
    layers, or none if nothing in it names a layer. `layers`: the compile's reading of the graph's
    registered ops (read here when not given)."""
    schedule = config.schedule
    graph = gm.graph
    if layers is None:
        layers = GraphLayers.read(graph, config.matcher, schedule.names)
    resolved = resolved_ops(layers.for_config(config), schedule)
    if kvpp_nodes(graph):
        _stamp_cache_ops(resolved)
        return InsertResult(changed=False, layers=())
    order = {node: i for i, node in enumerate(graph.nodes)}
    if any(op.source is not None for op in resolved):
        return _insert_run_time_layer(graph, order, resolved, config)
    groups = group_layers(resolved, schedule)
    operands = {group.layer: cache_operands(group, order) for group in groups}
    refuse_shared_caches(operands)
    refuse_stray_readers(graph, groups, operands)
    if not groups:
        refuse_a_graph_without_layers(graph, schedule, config.specs, graph_breaks)
        _stamp_cache_ops(resolved)
        return InsertResult(changed=False, layers=())
    check_layer_run([group.layer for group in groups], schedule, graph_breaks)
    refuse_undeclared_tables(groups)
    tables = {group.layer: table_operands(group, order) for group in groups}
    _stamp_cache_ops(resolved)

    names = {group.layer: group.name for group in groups}
    waits, prefetches = [], []
    contiguous: dict = {}
    first = groups[0]
    if not schedule.pending_at_entry(first.layer):
        if config.first_prefetch == "at_first_wait":
            where = graph.inserting_before(first.nodes[0])
        elif placeholders := graph.find_nodes(op="placeholder"):
            where = graph.inserting_after(placeholders[-1])
        else:
            where = graph.inserting_before(next(iter(graph.nodes)))
        with where:
            prefetches.append(_prefetch(graph, schedule.first(), first.name))

    for group in groups:
        wait_step, *then = schedule.at_layer(group.layer)
        with graph.inserting_before(group.nodes[0]):
            wait_stamp = NodeStamp("wait", group.layer, group.name, wait_step.slot)
            wait, replaces = _bundle_op(graph, WAIT_OP, (group.layer, wait_step.slot), operands[group.layer],
                                        tables[group.layer], wait_stamp, f"L{group.layer}", contiguous)
            for step in then:
                prefetches.append(_prefetch(graph, step, names.get(step.layer, f"layers.{step.layer}")))
        waits.append(wait)
        _rebind(group, replaces)

    logger.debug("kvpp insert pass: %d layers rewritten", len(groups))
    return InsertResult(True, tuple(g.layer for g in groups), tuple(waits), tuple(prefetches))


def _insert_run_time_layer(graph: torch.fx.Graph, order: dict[torch.fx.Node, int], resolved: list[ResolvedOp],
                           config: PassConfig) -> InsertResult:
    """One ``enter_layer`` for the graph's one run-time layer, and its ops rebound to its views."""
    group = run_time_layer_group(resolved, config.schedule)
    reads = cache_operands(group, order)
    refuse_stray_readers(graph, [group], {RUN_TIME_LAYER: reads})
    refuse_undeclared_tables([group])
    layer_tables = table_operands(group, order)
    _stamp_cache_ops(resolved)
    source = next(op.source for op in resolved if op.source is not None)
    with graph.inserting_before(group.nodes[0]):
        enter, replaces = _bundle_op(graph, ENTER_LAYER_OP, (source,), reads, layer_tables,
                                     NodeStamp("enter", RUN_TIME_LAYER, group.name), "layer", {})
    _rebind(group, replaces)
    logger.debug("kvpp insert pass: one run-time layer (%s) rewritten", source.name)
    return InsertResult(True, (), (enter,), run_time_layer=True)


def _bundle_op(graph: torch.fx.Graph, target: torch._ops.OpOverload, leading: tuple, caches: Operands,
               tables: Operands, op_stamp: NodeStamp, suffix: str, contiguous: dict) -> tuple[torch.fx.Node, dict]:
    """A ``wait`` or ``enter_layer`` node (``kvpp_<role>_<suffix>``) taking the layer's caches and tables,
    then one ``getitem`` per cache (``<component>_<suffix>``) and one per table (``<table>_<suffix>``), in
    the order the op returns them, each stamped like the op with its role and component or table kind.
    Returns the op and what its outputs replace: each component's view, and each table's."""
    kwargs = {"tables": [node for node, _ in tables], "table_kinds": [kind for _, kind in tables]} if tables else {}
    op = graph.create_node("call_function", target,
                           (*leading, [node for node, _ in caches], [component for _, component in caches]),
                           kwargs, name=f"kvpp_{op_stamp.role}_{suffix}")
    op.meta["val"] = [_contiguous_like(node_value(node), contiguous) for node, _ in (*caches, *tables)]
    stamp(op, op_stamp)
    outputs = [(component, f"{component}_{suffix}", "view", component) for _, component in caches]
    outputs += [(node, f"{node.name.rstrip('_')}_{suffix}", "table", kind) for node, kind in tables]
    replaces = {}
    for i, (replaced, name, role, what) in enumerate(outputs):
        view = graph.create_node("call_function", operator.getitem, (op, i), name=name)
        view.meta["val"] = op.meta["val"][i]
        stamp(view, dataclasses.replace(op_stamp, role=role, component=what))
        replaces[replaced] = view
    return op, replaces


def _rebind(group: LayerNodes, replaces: dict) -> None:
    """Each registered op of the layer reads its cache operands (by component) and its declared table
    operands (by value) from the op's outputs."""
    for node, spec in zip(group.nodes, group.specs):
        for operand in spec.cache_operands:
            set_arg(node, operand.arg, replaces[operand.component])
        for operand in spec.tables:
            value = get_arg(node, operand.arg)
            if isinstance(value, torch.fx.Node):
                set_arg(node, operand.arg, replaces[value])


def _stamp_cache_ops(resolved: list[ResolvedOp]) -> None:
    for op in resolved:
        stamp(op.node, NodeStamp("cache_op", op.layer, op.name, spec=op.spec))


def _contiguous_like(value, made: dict):
    """Wait's outputs are contiguous views of the runtime's storage, whatever the inputs' strides. One
    (fake or meta) tensor per shape, dtype and device serves every wait's metadata: nothing mutates it."""
    if not isinstance(value, torch.Tensor):
        return value
    fake_mode = getattr(value, "fake_mode", None)
    symbolic = any(isinstance(size, torch.SymInt) for size in value.shape)  # a table's token count
    key = (tuple(value.shape), value.dtype, value.device, id(fake_mode)) if not symbolic else object()
    if key not in made:
        if fake_mode is not None:
            with fake_mode:
                made[key] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
        else:
            made[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    return made[key]


def _prefetch(graph: torch.fx.Graph, step: ScheduleStep, name: str) -> torch.fx.Node:
    node = graph.create_node("call_function", PREFETCH_OP, (step.layer, step.slot), name=f"kvpp_prefetch_L{step.layer}")
    node.meta["val"] = None
    stamp(node, NodeStamp("prefetch", step.layer, name, step.slot))
    return node
