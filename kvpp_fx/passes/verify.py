"""Verify a rewritten (and optionally split) graph on its own. Run after the other passes.

The verifier does not reuse the insert pass: it finds the kvpp ops by their overloads and the
registered attention/cache ops by name, with the configuration's `OpMatcher` (the insert pass's
precedence rule) but not the insert pass's stamps, resolves their layers itself, and checks the graph
as it stands. `GraphFacts` reads the graph once; each check is a small function over it, listed with
its name in `CHECKS`; a failure lists every problem with the check that found it
(`KVPPGraphVerificationError.checks`):

- ``layers``: every kvpp op names a target layer (never a draft or unknown layer); the layers the
  graph holds are a contiguous run of the plan's target layers;
- ``counts``: each layer the graph holds is awaited exactly once; each layer it must prefetch (its
  first layer when that is the plan's first, and the plan's successor of each of its layers) is
  prefetched exactly once, and no other;
- ``slots``: every kvpp op's slot argument equals the plan's slot for its layer;
- ``outstanding``: walking the graph in order, at most one prefetch is outstanding, and each wait
  completes the outstanding one (a graph that does not start the plan starts with its first layer
  outstanding);
- ``order``: prefetches and waits follow the plan's order;
- ``slot_reuse``: the prefetch into a slot comes after every reader of that slot by earlier layers;
- ``components``: each wait's component names belong to its layer's bundle;
- ``binding``: every registered op of an awaited layer comes after that layer's wait, and each of its
  cache operands is the wait's output for that component;
- ``tables``: each declared table operand (block table, slot mapping) of a registered op of an
  awaited layer is the wait's output for that table (given to the wait as ``tables=``, of the declared
  kind); run-time-layer graphs, the enter's;
- ``originals``: the original cache values (the waits' inputs, and graph inputs that are KVPP
  handles) are read only by waits, and each by the wait of one layer only;
- ``routing``: owner mode is all or nothing: either no wait is routed and no registered op is a
  `RoutedOp`, or every wait is routed and every registered op of an awaited layer is declared
  `RoutesItself` (and left as it is) or is a `RoutedOp` of that layer whose rule is its spec's declaration (owner-local, or head-separable with the declared
  head operands, dimensions and output dimension), and an owner-local op's output is read only by
  routed ops of its layer, never as a head operand;
- ``pieces``: no compiled piece contains a kvpp op or a registered op;
- ``run_time_layer``: in a graph whose registered ops take their layer from a run-time value (a SymInt
  input), there is exactly one ``kvpp.enter_layer``, no other kvpp op and no op of a constant target
  layer; the enter takes that value, every such op reads it too, comes after the enter, and reads each
  cache operand from the enter's output for that component. Which layer the value names, its slot, and
  that the layers come in plan order with none skipped are checked by the runtime, at the enter
  (`KVPPRuntime.enter_layer`), as for the kvpp ops of a graph with constant layers.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.fx

from kvpp_fx.ops import is_routed_op, kvpp_op_kind
from kvpp_fx.schedule import ENTER_LAYER, PREFETCH, WAIT, LayerSchedule, ScheduleStep
from kvpp_fx.passes.pass_config import KVPPPassError, PassConfig, is_kvpp_handle
from kvpp_fx.passes.registry import (
    AttentionOpSpec,
    HeadSeparable,
    LayerResolutionError,
    OpMatcher,
    OwnerLocal,
    RoutesItself,
    arg_location,
    get_arg,
    layer_of,
    run_time_layer_input,
)

class KVPPGraphVerificationError(KVPPPassError):
    """A rewritten graph breaks one of the KVPP invariants."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        self.checks = {check for check, _ in problems}
        super().__init__("KVPP graph verification failed:\n  - "
                         + "\n  - ".join(f"[{check}] {message}" for check, message in problems))


def _kvpp_kind(node: torch.fx.Node) -> str | None:
    return kvpp_op_kind(node.target) if node.op == "call_function" else None


def _is_routed_wait(wait: torch.fx.Node) -> bool:
    return bool(wait.kwargs.get("routed", wait.args[4] if len(wait.args) > 4 else False))


@dataclass(frozen=True)
class RegisteredOp:
    node: torch.fx.Node
    spec: AttentionOpSpec
    layer: int


@dataclass(frozen=True)
class GraphFacts:
    """What the checks read, gathered in one walk over the graph. ``all_*`` hold every kvpp op and
    registered op found; the plain lists only those of the plan's target layers (the ``layers`` check
    reports the others)."""

    schedule: LayerSchedule
    specs: tuple[AttentionOpSpec, ...]
    match: OpMatcher
    nodes: list[torch.fx.Node]
    position: dict[torch.fx.Node, int]
    drafts: set[int]
    unresolved: list[str]  # registered ops whose layer could not be read
    all_waits: list[torch.fx.Node]
    all_prefetches: list[torch.fx.Node]
    all_registered: list[RegisteredOp]
    kvpp_in_order: list[tuple[str, torch.fx.Node]]
    waits: list[torch.fx.Node]
    prefetches: list[torch.fx.Node]
    registered: list[RegisteredOp]
    held: list[int]  # the target layers the graph holds, in plan order
    wait_of: dict[int, torch.fx.Node]  # each held layer's (first) wait
    expected: tuple[ScheduleStep, ...]  # the plan's schedule for the held layers
    pieces: tuple
    enters: list[torch.fx.Node]
    run_time_ops: list[tuple[RegisteredOp, torch.fx.Node]]  # registered ops and the value naming their layer

    @classmethod
    def read(cls, graph: torch.fx.Graph, config: PassConfig, pieces: Iterable = ()) -> GraphFacts:
        schedule = config.schedule
        nodes = list(graph.nodes)
        drafts = set(schedule.draft_layers)
        unresolved: list[str] = []
        waits: list[torch.fx.Node] = []
        prefetches: list[torch.fx.Node] = []
        kvpp_in_order: list[tuple[str, torch.fx.Node]] = []
        registered: list[RegisteredOp] = []
        enters: list[torch.fx.Node] = []
        run_time_ops: list[tuple[RegisteredOp, torch.fx.Node]] = []
        for node in nodes:
            if node.op != "call_function":
                continue
            kind = _kvpp_kind(node)
            if kind == ENTER_LAYER:
                enters.append(node)
                continue
            if kind is not None:
                (waits if kind == WAIT else prefetches).append(node)
                kvpp_in_order.append((kind, node))
                continue
            spec = config.matcher(node)
            if spec is None:
                continue
            source = run_time_layer_input(node, spec)
            if source is not None:
                run_time_ops.append((RegisteredOp(node, spec, -1), source))
                continue
            try:
                layer = layer_of(node, spec, schedule.names or None)[0]
            except LayerResolutionError as exc:
                unresolved.append(str(exc))
                continue
            if layer not in drafts:
                registered.append(RegisteredOp(node, spec, layer))
        targeted = [w for w in waits if schedule.is_target(w.args[0])]
        targeted_prefetches = [p for p in prefetches if schedule.is_target(p.args[0])]
        targeted_ops = [op for op in registered if schedule.is_target(op.layer)]
        held = sorted({op.layer for op in targeted_ops} | {w.args[0] for w in targeted}, key=schedule.position)
        wait_of: dict[int, torch.fx.Node] = {}
        for wait in targeted:
            wait_of.setdefault(wait.args[0], wait)
        expected = tuple(step for layer in held for step in schedule.entry(layer))
        return cls(schedule, config.specs, config.matcher, nodes, {node: i for i, node in enumerate(nodes)},
                   drafts, unresolved, waits, prefetches, registered, kvpp_in_order, targeted,
                   targeted_prefetches, targeted_ops, held, wait_of, expected, tuple(pieces), enters, run_time_ops)


def check_layers(g: GraphFacts) -> Iterator[str]:
    yield from g.unresolved
    for node in g.all_waits + g.all_prefetches:
        layer = node.args[0] if node.args else None
        if layer in g.drafts:
            yield f"{node.name} is a kvpp op for draft layer {layer}, which is never broadcast."
        elif not g.schedule.is_target(layer):
            yield (f"{node.name} is a kvpp op for layer {layer!r}, which is not a target layer of the plan "
                   f"{list(g.schedule.target_layers)}.")
    for op in g.all_registered:
        if not g.schedule.is_target(op.layer):
            yield f"{op.node.name} touches layer {op.layer}, which is neither a target nor a draft."
    held = g.held
    positions = [g.schedule.position(layer) for layer in held]
    if held and positions != list(range(positions[0], positions[-1] + 1)):
        yield f"the graph holds layers {held}, not a contiguous run of the plan {list(g.schedule.target_layers)}."


def check_counts(g: GraphFacts) -> Iterator[str]:
    for layer in g.held:
        awaited = sum(w.args[0] == layer for w in g.waits)
        if awaited != 1:
            yield f"layer {layer} is awaited {awaited} times, expected once."
    expected = [step.layer for step in g.expected if step.kind == PREFETCH]
    prefetched = [p.args[0] for p in g.prefetches]
    for layer in dict.fromkeys(expected + prefetched):
        got, want = prefetched.count(layer), expected.count(layer)
        if got != want:
            yield f"layer {layer} is prefetched {got} times, expected {want}."


def check_slots(g: GraphFacts) -> Iterator[str]:
    for node in g.waits + g.prefetches:
        layer, slot = node.args[0], node.args[1]
        if slot != g.schedule.slot(layer):
            yield f"{node.name} uses slot {slot!r} for layer {layer}; the plan's slot is {g.schedule.slot(layer)}."


def check_outstanding(g: GraphFacts) -> Iterator[str]:
    """One prefetch in flight, and each wait completes it."""
    pending = g.held[0] if g.held and g.schedule.position(g.held[0]) > 0 else None
    for kind, node in g.kvpp_in_order:
        layer = node.args[0]
        if not g.schedule.is_target(layer):
            continue
        if kind == PREFETCH:
            if pending is not None:
                yield f"{node.name} prefetches layer {layer} while layer {pending}'s prefetch is still outstanding."
            pending = layer
        else:
            if pending != layer:
                yield (f"{node.name} waits for layer {layer}, but the outstanding prefetch is "
                       f"{'none' if pending is None else f'layer {pending}'}.")
            pending = None


def check_order(g: GraphFacts) -> Iterator[str]:
    for what, seq in (("prefetches", [p.args[0] for p in g.prefetches]), ("waits", [w.args[0] for w in g.waits])):
        positions = [g.schedule.position(l) for l in seq]
        if positions != sorted(positions):
            yield f"the graph's {what} run over layers {seq}, not in the plan's order {list(g.schedule.target_layers)}."


def check_slot_reuse(g: GraphFacts) -> Iterator[str]:
    """Each prefetch against the readers of earlier layers on its slot: the layer's views, their
    readers and its registered ops."""
    readers: dict[int, list[torch.fx.Node]] = {layer: [] for layer in g.held}
    for layer, wait in g.wait_of.items():
        for user in wait.users:
            readers[layer].append(user)
            readers[layer].extend(user.users)
    for op in g.registered:
        readers[op.layer].append(op.node)
    last_read = {layer: max((g.position[n] for n in ns), default=-1) for layer, ns in readers.items()}
    for prefetch in g.prefetches:
        layer = prefetch.args[0]
        slot = g.schedule.slot(layer)
        for earlier in g.held:
            if g.schedule.position(earlier) < g.schedule.position(layer) and g.schedule.slot(earlier) == slot \
                    and last_read[earlier] > g.position[prefetch]:
                late = sorted({n.name for n in readers[earlier] if g.position[n] > g.position[prefetch]})
                yield (f"{prefetch.name} refills slot {slot} for layer {layer} before the last reader of layer "
                       f"{earlier} ({', '.join(late)}).")


def check_components(g: GraphFacts) -> Iterator[str]:
    declared = {operand.component for spec in g.specs for operand in spec.cache_operands}
    for wait in g.waits:
        layer, caches, components = wait.args[0], wait.args[2], wait.args[3]
        valid = g.schedule.components.get(layer, declared) if g.schedule.components else declared
        if len(caches) != len(components):
            yield f"{wait.name} has {len(caches)} caches but {len(components)} names."
        bad = [c for c in components if c not in valid]
        if bad or len(set(components)) != len(components):
            yield (f"{wait.name} names components {list(components)}; layer {layer}'s bundle has {sorted(valid)}, "
                   "each at most once.")


def check_binding(g: GraphFacts) -> Iterator[str]:
    for op in g.registered:
        node, layer = op.node, op.layer
        wait = g.wait_of.get(layer)
        if wait is None:  # reported by counts
            continue
        if g.position[wait] > g.position[node]:
            yield f"{node.name} touches layer {layer}'s cache before its wait."
            continue
        names = list(wait.args[3])
        for operand in op.spec.cache_operands:
            value = get_arg(node, operand.arg)
            if not _is_output_for(value, wait, names, operand.component):
                yield (f"{node.name} reads layer {layer}'s {operand.component!r} cache from "
                       f"{getattr(value, 'name', value)}, not from {wait.name}'s {operand.component!r} output.")


def check_tables(g: GraphFacts) -> Iterator[str]:
    ops = [(op, g.wait_of.get(op.layer)) for op in g.registered]
    if g.enters:
        ops += [(op, g.enters[0]) for op, _ in g.run_time_ops]
    for op, source in ops:
        if source is None or g.position[source] > g.position[op.node]:  # reported by binding
            continue
        caches = source.args[2] if _kvpp_kind(source) == WAIT else source.args[1]
        tables, kinds = _tables_of(source)
        for operand in op.spec.tables:
            read = get_arg(op.node, operand.arg)
            if not isinstance(read, torch.fx.Node):
                continue
            index = (read.args[1] - len(caches) if read.op == "call_function" and read.target is operator.getitem
                     and read.args[0] is source and isinstance(read.args[1], int) else -1)
            if not 0 <= index < len(tables) or kinds[index] != operand.kind:
                yield (f"{op.node.name} reads its {operand.kind} from {read.name}, not from {source.name}'s "
                       f"{operand.kind} output: a rank reading a packed scratch slot would read it unremapped.")


def _tables_of(node: torch.fx.Node) -> tuple[list, list]:
    """A wait's or enter's ``tables`` and ``table_kinds`` (keywords, or the trailing positionals)."""
    first = 5 if _kvpp_kind(node) == WAIT else 3
    tables = node.kwargs.get("tables", node.args[first] if len(node.args) > first else None) or []
    kinds = node.kwargs.get("table_kinds", node.args[first + 1] if len(node.args) > first + 1 else None) or []
    return list(tables), list(kinds)


def check_originals(g: GraphFacts) -> Iterator[str]:
    originals = {c for wait in g.waits for c in wait.args[2] if isinstance(c, torch.fx.Node)}
    originals |= {c for enter in g.enters for c in enter.args[1] if isinstance(c, torch.fx.Node)}
    originals |= {n for n in g.nodes if n.op == "placeholder"
                  and is_kvpp_handle(n.meta.get("val", n.meta.get("example_value")))}
    for value in sorted(originals, key=g.position.__getitem__):
        for user in value.users:
            if _kvpp_kind(user) not in (WAIT, ENTER_LAYER):
                yield (f"{user.name} reads the original cache value {value.name}; only kvpp.wait (or "
                       "kvpp.enter_layer) may read it.")
        layers_of_value = sorted({user.args[0] for user in value.users if _kvpp_kind(user) == WAIT})
        if len(layers_of_value) > 1:
            yield (f"the original cache value {value.name} is awaited as the cache of layers {layers_of_value}; "
                   "each layer's cache is its own.")


def check_routing(g: GraphFacts) -> Iterator[str]:
    routed_waits = [w for w in g.waits if _is_routed_wait(w)]
    if not routed_waits and not any(is_routed_op(op.node.target) for op in g.registered):
        return
    if len(routed_waits) != len(g.waits):
        plain = [w.name for w in g.waits if not _is_routed_wait(w)]
        yield f"waits {plain} are not routed while others are; owner mode is all or nothing per graph."
    owner_run = {op.node: op.layer for op in g.registered if is_routed_op(op.node.target)}
    for op in g.registered:
        node, spec, layer, target = op.node, op.spec, op.layer, op.node.target
        if isinstance(spec.owner, RoutesItself) and not is_routed_op(target):
            wait = g.wait_of.get(layer)
            if wait is not None and not _is_routed_wait(wait):
                yield f"{node.name} routes its own owner rows but its layer's wait {wait.name} is not routed."
            continue
        if not is_routed_op(target):
            yield (f"{node.name} touches layer {layer}'s cache without routing in a routed graph; in owner mode it "
                   "would read a scratch slot that is not filled.")
            continue
        if target.layer != layer:
            yield f"{node.name} is routed for layer {target.layer} but touches layer {layer}."
        wait = g.wait_of.get(layer)
        if wait is not None and not _is_routed_wait(wait):
            yield f"{node.name} is routed but its layer's wait {wait.name} is not."
        rule = spec.owner
        if isinstance(rule, OwnerLocal):
            if target.heads:
                yield f"{node.name} is routed as head-separable, but {spec.op} is declared OwnerLocal."
            for user in node.users:
                if owner_run.get(user) != layer:
                    yield (f"{user.name} reads the owner-local output of {node.name}, which is None on the ranks "
                           f"that do not own layer {layer}.")
                elif any(_arg_at(user, where) is node for where, _ in user.target.heads):
                    yield f"{user.name} takes the owner-local output of {node.name} as a head operand."
        elif isinstance(rule, HeadSeparable):
            try:
                declared = tuple((arg_location(node, o.arg), o.dim) for o in rule.operands)
            except LayerResolutionError as exc:
                yield f"{node.name}: {exc}"
                continue
            tokens = tuple(o.token_dim for o in rule.operands)
            if (target.heads, target.output_dim, target.output_like, target.token_dims, target.rows) != \
                    (declared, rule.output_dim, rule.output_like, tokens, rule.rows):
                yield (f"{node.name} is routed with heads {target.heads}, output dimension {target.output_dim}, "
                       f"output like {target.output_like}, token dimensions {target.token_dims}; {spec.op} "
                       f"declares {declared}, {rule.output_dim}, {rule.output_like}, {tokens}.")
        else:
            yield f"{node.name} is routed, but {spec.op} declares no owner rule."


def check_pieces(g: GraphFacts) -> Iterator[str]:
    for piece in g.pieces:
        if piece.is_eager:
            continue
        bad = [n.name for n in piece.graph_module.graph.nodes if _kvpp_kind(n) or g.match(n) is not None]
        if bad:
            yield f"compiled piece {piece.name} contains kvpp or cache ops: {', '.join(bad)}."


def check_run_time_layer(g: GraphFacts) -> Iterator[str]:
    if not g.enters and not g.run_time_ops:
        return
    if len(g.enters) != 1:
        yield (f"the graph's layer is a run-time value and it has {len(g.enters)} kvpp.enter_layer ops "
               f"({', '.join(n.name for n in g.enters) or 'none'}); expected exactly one.")
    others = [n.name for n in g.all_waits + g.all_prefetches] + [op.node.name for op in g.registered]
    if others:
        yield (f"the graph's layer is a run-time value, but it also holds kvpp ops or cache ops of constant layers: "
               f"{', '.join(others)}.")
    if not g.enters:
        return
    enter = g.enters[0]
    source, names = enter.args[0], list(enter.args[2])
    value = source.meta.get("val", source.meta.get("example_value")) if isinstance(source, torch.fx.Node) else None
    if not isinstance(value, torch.SymInt):
        yield f"{enter.name} names layer {getattr(source, 'name', source)!r}, which is not a run-time value."
    declared = {operand.component for spec in g.specs for operand in spec.cache_operands}
    if len(enter.args[1]) != len(names) or any(c not in declared for c in names) or len(set(names)) != len(names):
        yield f"{enter.name} names components {names} for {len(enter.args[1])} caches; declared: {sorted(declared)}."
    for op, op_source in g.run_time_ops:
        node = op.node
        if op_source is not source:
            yield f"{node.name} reads its layer from {op_source.name}, but {enter.name} enters the layer {source}."
        if g.position[enter] > g.position[node]:
            yield f"{node.name} touches the layer's cache before {enter.name}."
            continue
        for operand in op.spec.cache_operands:
            read = get_arg(node, operand.arg)
            if not _is_output_for(read, enter, names, operand.component):
                yield (f"{node.name} reads its {operand.component!r} cache from {getattr(read, 'name', read)}, not "
                       f"from {enter.name}'s {operand.component!r} output.")


def _is_output_for(value: object, op: torch.fx.Node, names: list[str], component: str) -> bool:
    """Whether `value` is the output of a wait or enter `op` for `component` (a ``getitem`` of it)."""
    return (isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target is operator.getitem
            and value.args[0] is op and isinstance(value.args[1], int) and value.args[1] < len(names)
            and names[value.args[1]] == component)


def _arg_at(node: torch.fx.Node, where: int | str):
    if isinstance(where, str):
        return node.kwargs.get(where)
    return node.args[where] if where < len(node.args) else None


CHECKS: tuple[tuple[str, Callable[[GraphFacts], Iterator[str]]], ...] = (
    ("layers", check_layers),
    ("counts", check_counts),
    ("slots", check_slots),
    ("outstanding", check_outstanding),
    ("order", check_order),
    ("slot_reuse", check_slot_reuse),
    ("components", check_components),
    ("binding", check_binding),
    ("tables", check_tables),
    ("originals", check_originals),
    ("routing", check_routing),
    ("pieces", check_pieces),
    ("run_time_layer", check_run_time_layer),
)


def verify_graph(gm: torch.fx.GraphModule, config: PassConfig, pieces: Iterable = ()) -> None:
    """Raise `KVPPGraphVerificationError` with every problem of `gm`'s graph (and of the compiled
    `pieces` of its split), each under the name of the check that found it."""
    facts = GraphFacts.read(gm.graph, config, pieces)
    problems = [(name, message) for name, check in CHECKS for message in check(facts)]
    if problems:
        raise KVPPGraphVerificationError(problems)
