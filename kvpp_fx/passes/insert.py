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
kvpp ops is the plan's `LayerSchedule`, computed nowhere else.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from kvpp_fx import ops
from kvpp_fx.ops import kvpp_nodes
from kvpp_fx.schedule import LayerSchedule, ScheduleStep
from kvpp_fx.passes.pass_config import KVPPPassError, NodeStamp, PassConfig, is_kvpp_handle, node_value, stamp
from kvpp_fx.passes.registry import (
    LAYER_NAME_PATTERN,
    AttentionOpSpec,
    get_arg,
    layer_of,
    run_time_layer_input,
    set_arg,
)

logger = logging.getLogger(__name__)

# The graph targets the pass writes: the overloads, as AOT writes them too.
WAIT_OP, PREFETCH_OP, ENTER_LAYER_OP = ops.wait.default, ops.prefetch.default, ops.enter_layer.default
RUN_TIME_LAYER = -1  # the layer of a stamp in a graph whose layer is a run-time value
REGISTER_HINT = ("give the backend an AttentionOpSpec for the op that reads it, naming its cache operand "
                 "(kvpp_backend(..., specs=...), or register_attention_op for the default specs), or keep "
                 "the read inside a registered op")


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
    run_time_layer: bool = False  # one layer, named by a graph input at run time (`enter_layer`)


def handle_placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.find_nodes(op="placeholder") if is_kvpp_handle(node_value(n))]


def resolve_layer(node: torch.fx.Node, spec: AttentionOpSpec, schedule: LayerSchedule) -> tuple[int, str]:
    """The layer of a registered op, refusing a layer that only an unguarded graph input names."""
    raw = get_arg(node, spec.layer_arg)
    if isinstance(raw, torch.fx.Node):
        if not schedule.names:
            raise UnguardedLayerError(
                f"{node.format_node()} takes its layer from the graph input {raw.name!r}. Dynamo does not "
                "guard that value, so a graph reused for another layer would use the wrong index; give the "
                "backend a name->index map (names=...) or pass the layer as a constant.")
        layer, name = layer_of(node, spec, schedule.names)
        if name not in schedule.names:
            raise UnguardedLayerError(f"{node.format_node()}: layer name {name!r} from the graph input "
                                      f"{raw.name!r} is not in the name->index map.")
        return layer, name
    return layer_of(node, spec, schedule.names or None)


@dataclass(frozen=True)
class ResolvedOp:
    """A registered op of the graph, its layer and the spec it matched."""

    node: torch.fx.Node
    layer: int  # RUN_TIME_LAYER when the layer is the value of `source`
    name: str
    spec: AttentionOpSpec
    source: torch.fx.Node | None = None


def resolve_cache_ops(nodes: list[torch.fx.Node], config: PassConfig) -> list[ResolvedOp]:
    """Every registered op in graph order, draft layers included: the one layer resolution of a compile.
    A layer that is neither a target nor a draft is refused."""
    schedule = config.schedule
    known = set(schedule.target_layers) | set(schedule.draft_layers)
    resolved = []
    for node in nodes:
        spec = config.matcher(node)
        if spec is None:
            continue
        source = run_time_layer_input(node, spec)
        if source is not None:
            resolved.append(ResolvedOp(node, RUN_TIME_LAYER, source.name, spec, source))
            continue
        layer, name = resolve_layer(node, spec, schedule)
        if layer not in known:
            raise UnknownGraphLayerError(
                f"{node.format_node()} touches layer {layer} ({name}), which is neither a target nor a "
                f"draft layer of the plan (targets {list(schedule.target_layers)}).")
        resolved.append(ResolvedOp(node, layer, name, spec))
    return resolved


def group_layers(resolved: list[ResolvedOp], schedule: LayerSchedule) -> list[LayerNodes]:
    """The target layers' ops grouped by layer, in order of each layer's first op."""
    drafts = set(schedule.draft_layers)
    groups: dict[int, list[ResolvedOp]] = {}
    for op in resolved:
        if op.layer not in drafts:
            groups.setdefault(op.layer, []).append(op)
    return [LayerNodes(layer, ops[0].name, tuple(op.node for op in ops), tuple(op.spec for op in ops))
            for layer, ops in groups.items()]


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


def insert_kvpp_ops(gm: torch.fx.GraphModule, config: PassConfig, *, graph_breaks: bool = False) -> InsertResult:
    """Rewrite `gm`'s graph in place (see the module docstring); the caller regenerates ``gm.code``.
    `graph_breaks`: graph breaks may have split the model, so this graph may hold a run of the plan's
    layers, or none if nothing in it names a layer."""
    schedule = config.schedule
    graph = gm.graph
    nodes = list(graph.nodes)
    resolved = resolve_cache_ops(nodes, config)
    if kvpp_nodes(graph):
        _stamp_cache_ops(resolved)
        return InsertResult(changed=False, layers=())
    if any(op.source is not None for op in resolved):
        return _insert_run_time_layer(graph, nodes, resolved, schedule)
    layers = group_layers(resolved, schedule)
    order = {node: i for i, node in enumerate(nodes)}
    operands = {group.layer: _cache_operands(group, order) for group in layers}
    _refuse_shared_caches(operands)
    _refuse_stray_readers(graph, layers, operands)
    if not layers:
        mention = _layer_mention(graph, schedule) if schedule.target_layers else None
        if schedule.target_layers and (not graph_breaks or mention is not None):
            why = (f"{mention} names a target layer" if mention is not None else
                   "the graph is the whole compiled function (fullgraph)")
            raise NoGraphLayersError(
                f"the plan has target layers {list(schedule.target_layers)} but no node of this graph is a "
                f"registered attention/cache op of one of them, and {why}; registered ops: "
                f"{[s.op for s in config.specs]}. Give the backend the model's attention op "
                "(kvpp_backend(..., specs=...), or register_attention_op for the default specs).")
        _stamp_cache_ops(resolved)
        return InsertResult(changed=False, layers=())
    check_layer_run([group.layer for group in layers], schedule, graph_breaks)
    _refuse_undeclared_tables(layers)
    _stamp_cache_ops(resolved)

    names = {group.layer: group.name for group in layers}
    waits, prefetches = [], []
    contiguous: dict = {}
    first = layers[0]
    if schedule.position(first.layer) == 0:
        placeholders = [n for n in nodes if n.op == "placeholder"]
        if config.first_prefetch == "at_first_wait":
            where = graph.inserting_before(first.nodes[0])
        elif placeholders:
            where = graph.inserting_after(placeholders[-1])
        else:
            where = graph.inserting_before(nodes[0])
        with where:
            prefetches.append(_prefetch(graph, schedule.first(), first.name))

    tables = {group.layer: _table_operands(group, order) for group in layers}
    for group in layers:
        reads, layer_tables = operands[group.layer], tables[group.layer]
        wait_step, *then = schedule.at_layer(group.layer)
        with graph.inserting_before(group.nodes[0]):
            kwargs = _table_kwargs(layer_tables)
            wait = graph.create_node("call_function", WAIT_OP,
                                     (group.layer, wait_step.slot, [node for node, _ in reads],
                                      [component for _, component in reads]), kwargs,
                                     name=f"kvpp_wait_L{group.layer}")
            wait.meta["val"] = [_contiguous_like(node_value(node), contiguous)
                                for node, _ in (*reads, *layer_tables)]
            stamp(wait, NodeStamp("wait", group.layer, group.name, wait_step.slot))
            views = {}
            for i, (node, component) in enumerate(reads):
                view = graph.create_node("call_function", operator.getitem, (wait, i),
                                         name=f"{component}_L{group.layer}")
                view.meta["val"] = wait.meta["val"][i]
                stamp(view, NodeStamp("view", group.layer, group.name, wait_step.slot, component))
                views[component] = view
            rebound = _table_views(graph, wait, reads, layer_tables, f"L{group.layer}",
                                   NodeStamp("table", group.layer, group.name, wait_step.slot))
            for step in then:
                prefetches.append(_prefetch(graph, step, names.get(step.layer, f"layers.{step.layer}")))
        waits.append(wait)
        _rebind(group, views, rebound)

    logger.debug("kvpp insert pass: %d layers rewritten", len(layers))
    return InsertResult(True, tuple(g.layer for g in layers), tuple(waits), tuple(prefetches))


def _insert_run_time_layer(graph: torch.fx.Graph, nodes: list[torch.fx.Node], resolved: list[ResolvedOp],
                           schedule: LayerSchedule) -> InsertResult:
    """One ``enter_layer`` for the graph's one run-time layer, and its ops rebound to its views."""
    sources = sorted({op.source.name for op in resolved if op.source is not None})
    constant = sorted({op.layer for op in resolved if op.source is None and op.layer not in schedule.draft_layers})
    if len(sources) > 1 or constant:
        held = f"layers {constant} as constants and " if constant else ""
        raise RunTimeLayerGraphError(
            f"the graph's registered ops take {held}their layer index from the inputs {sources} at run time. A "
            "graph whose layer is a run-time value (one compiled frame serving several layers) must hold exactly "
            "one layer, named by one input; keep each layer's cache ops in the layer's own frame.")
    ops = [op for op in resolved if op.source is not None]
    group = LayerNodes(RUN_TIME_LAYER, ops[0].name, tuple(op.node for op in ops), tuple(op.spec for op in ops))
    reads = _cache_operands(group, {node: i for i, node in enumerate(nodes)})
    _refuse_stray_readers(graph, [group], {RUN_TIME_LAYER: reads})
    _refuse_undeclared_tables([group])
    _stamp_cache_ops(resolved)
    source = ops[0].source
    layer_tables = _table_operands(group, {node: i for i, node in enumerate(nodes)})
    with graph.inserting_before(group.nodes[0]):
        enter = graph.create_node("call_function", ENTER_LAYER_OP, (source, [node for node, _ in reads],
                                  [component for _, component in reads]), _table_kwargs(layer_tables),
                                  name="kvpp_enter_layer")
        enter.meta["val"] = [_contiguous_like(node_value(node), {}) for node, _ in (*reads, *layer_tables)]
        stamp(enter, NodeStamp("enter", RUN_TIME_LAYER, group.name))
        views = {}
        for i, (node, component) in enumerate(reads):
            view = graph.create_node("call_function", operator.getitem, (enter, i), name=f"{component}_layer")
            view.meta["val"] = enter.meta["val"][i]
            stamp(view, NodeStamp("view", RUN_TIME_LAYER, group.name, component=component))
            views[component] = view
        rebound = _table_views(graph, enter, reads, layer_tables, "layer",
                               NodeStamp("table", RUN_TIME_LAYER, group.name))
    _rebind(group, views, rebound)
    logger.debug("kvpp insert pass: one run-time layer (%s) rewritten", source.name)
    return InsertResult(True, (), (enter,), run_time_layer=True)


def _refuse_undeclared_tables(layers: list[LayerNodes]) -> None:
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


def _table_kwargs(tables: list[tuple[torch.fx.Node, str]]) -> dict:
    if not tables:
        return {}
    return {"tables": [node for node, _ in tables], "table_kinds": [kind for _, kind in tables]}


def _table_views(graph: torch.fx.Graph, wait: torch.fx.Node, reads: list, tables: list[tuple[torch.fx.Node, str]],
                 suffix: str, table_stamp: NodeStamp) -> dict[torch.fx.Node, torch.fx.Node]:
    """One ``getitem`` per table operand, after the caches' (the wait's outputs are caches, then tables)."""
    rebound = {}
    for i, (node, kind) in enumerate(tables):
        view = graph.create_node("call_function", operator.getitem, (wait, len(reads) + i),
                                 name=f"{node.name.rstrip('_')}_{suffix}")
        view.meta["val"] = wait.meta["val"][len(reads) + i]
        stamp(view, NodeStamp(table_stamp.role, table_stamp.layer, table_stamp.name, table_stamp.slot, kind))
        rebound[node] = view
    return rebound


def _rebind(group: LayerNodes, views: dict[str, torch.fx.Node], tables: dict[torch.fx.Node, torch.fx.Node]) -> None:
    for node, spec in zip(group.nodes, group.specs):
        for operand in spec.cache_operands:
            set_arg(node, operand.arg, views[operand.component])
        for operand in spec.tables:
            value = get_arg(node, operand.arg)
            if isinstance(value, torch.fx.Node):
                set_arg(node, operand.arg, tables[value])


def _table_operands(group: LayerNodes, order: dict[torch.fx.Node, int]) -> list[tuple[torch.fx.Node, str]]:
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


def _refuse_shared_caches(operands: dict[int, list[tuple[torch.fx.Node, str]]]) -> None:
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


def _refuse_stray_readers(graph: torch.fx.Graph, layers: list[LayerNodes],
                          operands: dict[int, list[tuple[torch.fx.Node, str]]]) -> None:
    """Every reader of a cache value must be one of its layer's registered ops reading it as a cache
    operand. Cache values are the registered cache operands and the graph inputs that are KVPP handles."""
    allowed: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for group in layers:
        for value, _ in operands[group.layer]:
            allowed.setdefault(value, set())
        for node, spec in zip(group.nodes, group.specs):
            for operand in spec.cache_operands:
                allowed[get_arg(node, operand.arg)].add(node)
    for handle in handle_placeholders(graph):
        allowed.setdefault(handle, set())
    for value, readers in allowed.items():
        for user in value.users:
            if user not in readers:
                raise StrayCacheReadError(
                    f"{user.format_node()} reads the cache value {value.name!r} outside the registered "
                    f"cache operands. Under KVPP that value is a handle without bytes (only kvpp.wait's "
                    f"output holds the layer's cache), so this read would be wrong; {REGISTER_HINT}.")
