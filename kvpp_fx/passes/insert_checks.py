"""What the insert pass reads from a graph before it changes anything, and what it refuses there.

Invariant: every refusal of the insert pass is raised here, from the graph as Dynamo captured it and
the compile's one layer reading (`kvpp_fx.passes.layers`), before the pass creates or rewires a node,
so a refused graph is left exactly as it was. Each refusal is a `KVPPPassError` subclass that names
the node and says what to change (docs/graph-contract.md lists them). What the checks gather for the
rewrite (each layer's ops, the cache and table operands they read) is what the rewrite uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from kvpp_fx.passes.layers import GraphLayers, ResolvedOp
from kvpp_fx.passes.pass_config import KVPPPassError, is_kvpp_handle, node_value
from kvpp_fx.passes.registry import LAYER_NAME_PATTERN, AttentionOpSpec, get_arg
from kvpp_fx.schedule import LayerSchedule

REGISTER_HINT = ("give the backend an AttentionOpSpec for the op that reads it, naming its cache operand "
                 "(kvpp_backend(..., specs=...), or register_attention_op for the default specs), or keep "
                 "the read inside a registered op")

Operands = list[tuple[torch.fx.Node, str]]  # (graph value, component or table kind), in order of first use


class LayerOrderError(KVPPPassError):
    """The graph's layers are not a contiguous run of the plan's target layers in plan order."""


class UnknownGraphLayerError(KVPPPassError):
    """The graph touches a layer that the schedule does not know."""


class CacheOperandError(KVPPPassError):
    """A cache operand cannot be rebound (defined too late, or two tensors for one component)."""


class StrayCacheReadError(KVPPPassError):
    """A layer's cache is read by a node that is not a registered cache operand (it would read the handle)."""


class UnremappedTablesError(KVPPPassError):
    """A target layer's cache op declares no table operands and does not remap its block ids itself."""


class NoGraphLayersError(KVPPPassError):
    """The plan has target layers but no registered op of this graph touches one."""


class UnguardedLayerError(KVPPPassError):
    """A registered op's layer comes from a graph input, which Dynamo does not guard."""


class RunTimeLayerGraphError(KVPPPassError):
    """A graph whose layer is a run-time value also holds other layers, or reads its layer from several
    inputs."""


@dataclass(frozen=True)
class LayerNodes:
    """One layer's registered ops in graph order, with the spec each matched."""

    layer: int
    name: str
    nodes: tuple[torch.fx.Node, ...]
    specs: tuple[AttentionOpSpec, ...]

    @classmethod
    def of(cls, ops: list[ResolvedOp]) -> LayerNodes:
        return cls(ops[0].layer, ops[0].name, tuple(op.node for op in ops), tuple(op.spec for op in ops))


def resolved_ops(layers: GraphLayers, schedule: LayerSchedule) -> list[ResolvedOp]:
    """Every registered op of the reading, draft layers included, after refusing the first op whose layer
    cannot be read, is named by an unguarded graph input, or is neither a target nor a draft."""
    known = set(schedule.target_layers) | set(schedule.draft_layers)
    for op in layers.ops:
        node, raw = op.node, op.argument
        if op.from_graph_input and not schedule.names:
            raise UnguardedLayerError(
                f"{node.format_node()} takes its layer from the graph input {raw.name!r}. Dynamo does not "
                "guard that value, so a graph reused for another layer would use the wrong index; give the "
                "backend a name->index map (names=...) or pass the layer as a constant.")
        if op.error is not None:
            raise op.error
        if op.from_graph_input and op.name not in schedule.names:
            raise UnguardedLayerError(f"{node.format_node()}: layer name {op.name!r} from the graph input "
                                      f"{raw.name!r} is not in the name->index map.")
        if op.source is None and op.layer not in known:
            raise UnknownGraphLayerError(
                f"{node.format_node()} touches layer {op.layer} ({op.name}), which is neither a target nor a "
                f"draft layer of the plan (targets {list(schedule.target_layers)}).")
    return list(layers.ops)


def group_layers(resolved: list[ResolvedOp], schedule: LayerSchedule) -> list[LayerNodes]:
    """The target layers' ops grouped by layer, in order of each layer's first op."""
    drafts = set(schedule.draft_layers)
    groups: dict[int, list[ResolvedOp]] = {}
    for op in resolved:
        if op.layer not in drafts:
            groups.setdefault(op.layer, []).append(op)
    return [LayerNodes.of(ops) for ops in groups.values()]


def run_time_layer_group(resolved: list[ResolvedOp], schedule: LayerSchedule) -> LayerNodes:
    """The ops of a graph whose layer is a run-time value, refusing one that also holds constant target
    layers or reads its layer from several inputs."""
    sources = sorted({op.source.name for op in resolved if op.source is not None})
    constant = sorted({op.layer for op in resolved if op.source is None and op.layer not in schedule.draft_layers})
    if len(sources) > 1 or constant:
        held = f"layers {constant} as constants and " if constant else ""
        raise RunTimeLayerGraphError(
            f"the graph's registered ops take {held}their layer index from the inputs {sources} at run time. A "
            "graph whose layer is a run-time value (one compiled frame serving several layers) must hold exactly "
            "one layer, named by one input; keep each layer's cache ops in the layer's own frame.")
    return LayerNodes.of([op for op in resolved if op.source is not None])


def check_layer_run(found: list[int], schedule: LayerSchedule, graph_breaks: bool) -> None:
    """`found` must be a contiguous slice of the plan's order; the whole plan unless graph breaks may have
    split the model. Across graphs, the runtime refuses a prefetch or wait out of plan order."""
    plan = list(schedule.target_layers)
    start = schedule.position(found[0])
    if found != plan[start:start + len(found)]:
        raise LayerOrderError(
            f"the graph's layers appear in the order {found}, but the plan's execution order is {plan}: "
            "ranks would issue broadcasts in a different order. With graph breaks, each graph must hold a "
            "contiguous run of the plan's layers in plan order.")
    if not graph_breaks and found != plan:
        raise LayerOrderError(
            f"the graph holds layers {found} but the plan's execution order is {plan}, and it is the whole "
            "compiled function (fullgraph): only a model split by graph breaks may hold part of the plan "
            "in one graph.")


def refuse_a_graph_without_layers(graph: torch.fx.Graph, schedule: LayerSchedule, specs: tuple[AttentionOpSpec, ...],
                                  graph_breaks: bool) -> None:
    """A graph without registered ops of a target layer passes only when graph breaks may have split the
    model and nothing in it names a target layer: it cannot read a cache."""
    if not schedule.target_layers:
        return
    mention = _layer_mention(graph, schedule)
    if not graph_breaks or mention is not None:
        why = (f"{mention} names a target layer" if mention is not None else
               "the graph is the whole compiled function (fullgraph)")
        raise NoGraphLayersError(
            f"the plan has target layers {list(schedule.target_layers)} but no node of this graph is a "
            f"registered attention/cache op of one of them, and {why}; registered ops: "
            f"{[s.op for s in specs]}. Give the backend the model's attention op "
            "(kvpp_backend(..., specs=...), or register_attention_op for the default specs).")


def refuse_undeclared_tables(layers: list[LayerNodes]) -> None:
    """Every registered op that reads a target layer's cache says where its block ids come from."""
    for group in layers:
        for node, spec in zip(group.nodes, group.specs):
            if spec.cache_operands and not spec.tables and not spec.remaps_itself:
                raise UnremappedTablesError(
                    f"{node.format_node()} reads layer {group.layer}'s cache, but its AttentionOpSpec ({spec.op}) "
                    "declares no block-table or slot-mapping operand (tables=(TableOperand(arg, 'block_table'), "
                    "...)): on a rank that reads the layer from a packed scratch slot it would index the slot "
                    "with the pool's block ids. Declare its tables, or remaps_itself=True where the integration "
                    "remaps them.")


def cache_operands(group: LayerNodes, order: dict[torch.fx.Node, int]) -> Operands:
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


def table_operands(group: LayerNodes, order: dict[torch.fx.Node, int]) -> Operands:
    """The distinct (table value, kind) pairs the layer's ops declare, in order of first use. A table
    given as a constant (no graph value) names no block of a cache the runtime places: left alone."""
    first = order[group.nodes[0]]
    seen: dict[torch.fx.Node, str] = {}
    for node, spec in zip(group.nodes, group.specs):
        for operand in spec.tables:
            value = get_arg(node, operand.arg)
            if not isinstance(value, torch.fx.Node):
                continue
            if seen.setdefault(value, operand.kind) != operand.kind:
                raise CacheOperandError(
                    f"layer {group.layer} reads {value.name} both as a {seen[value]} and as a {operand.kind}.")
            if order.get(value, -1) > first:
                raise CacheOperandError(
                    f"layer {group.layer}'s {operand.kind} ({value.name}) is defined after the layer's first "
                    "cache-touching node; the wait cannot take it.")
    return list(seen.items())


def refuse_shared_caches(operands: dict[int, Operands]) -> None:
    """One tensor read as the cache of two layers would be rebound to each layer's own view: refuse it."""
    owner: dict[torch.fx.Node, int] = {}
    for layer, pairs in operands.items():
        for value, _ in pairs:
            other = owner.setdefault(value, layer)
            if other != layer:
                raise CacheOperandError(
                    f"{value.name} is read as the cache of layers {other} and {layer}. Under KVPP each layer's "
                    "cache is its own view (persistent or a scratch slot), so a shared cache cannot be rebound; "
                    "give each layer its own cache tensor.")


def refuse_stray_readers(graph: torch.fx.Graph, layers: list[LayerNodes], operands: dict[int, Operands]) -> None:
    """Every reader of a cache value must be one of its layer's registered ops reading it as a cache
    operand. Cache values are the registered cache operands and the graph inputs that are KVPP handles."""
    allowed: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for group in layers:
        for value, _ in operands[group.layer]:
            allowed.setdefault(value, set())
        for node, spec in zip(group.nodes, group.specs):
            for operand in spec.cache_operands:
                allowed[get_arg(node, operand.arg)].add(node)
    for handle in graph.find_nodes(op="placeholder"):
        if is_kvpp_handle(node_value(handle)):
            allowed.setdefault(handle, set())
    for value, readers in allowed.items():
        for user in value.users:
            if user not in readers:
                raise StrayCacheReadError(
                    f"{user.format_node()} reads the cache value {value.name!r} outside the registered "
                    f"cache operands. Under KVPP that value is a handle without bytes (only kvpp.wait's "
                    f"output holds the layer's cache), so this read would be wrong; {REGISTER_HINT}.")


def _layer_mention(graph: torch.fx.Graph, schedule: LayerSchedule) -> str | None:
    """A node of a graph without registered ops that names a target layer (a layer name as a constant
    argument or as an input's value), which means the graph reaches a layer through an unregistered op."""
    targets = set(schedule.target_layers)

    def names_target(value: object) -> bool:
        value = getattr(getattr(value, "real_obj", value), "value", value)
        if not isinstance(value, str):
            return False
        if value in schedule.names:
            return schedule.names[value] in targets
        match = LAYER_NAME_PATTERN.search(value)
        return match is not None and int(match.group(1)) in targets

    for node in graph.nodes:
        if node.op == "placeholder" and names_target(node.meta.get("example_value", node.meta.get("val"))):
            return f"input {node.name!r}"
        if node.op == "call_function":
            for arg in (*node.args, *node.kwargs.values()):
                if names_target(arg):
                    return f"{node.format_node()}"
    return None
