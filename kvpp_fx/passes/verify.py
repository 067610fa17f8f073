"""Verify a rewritten (and optionally split) graph on its own. Run after the other passes.

The verifier does not reuse the insert pass: it finds the kvpp ops by their overloads and the
registered attention/cache ops by name, and checks the graph as it stands. Each check has a name; a
failure lists every problem with the check that found it (`KVPPGraphVerificationError.checks`):

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
- ``originals``: the original cache values (the waits' inputs, and graph inputs that are KVPP
  handles) are read only by waits, and each by the wait of one layer only;
- ``routing``: owner mode is all or nothing: either no wait is routed and no registered op is a
  `RoutedOp`, or every wait is routed and every registered op of an awaited layer is a `RoutedOp` of
  that layer whose rule is its spec's declaration (owner-local, or head-separable with the declared
  head operands, dimensions and output dimension), and an owner-local op's output is read only by
  routed ops of its layer, never as a head operand;
- ``pieces``: no compiled piece contains a kvpp op or a registered op.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx

from kvpp_fx.ops import is_routed_op
from kvpp_fx.passes.insert import KVPPPassError, is_kvpp_handle
from kvpp_fx.passes.layer_table import LayerTable
from kvpp_fx.passes.registry import (
    AttentionOpSpec,
    HeadSeparable,
    LayerResolutionError,
    OwnerLocal,
    arg_location,
    get_arg,
    layer_of,
    registered_specs,
)

KVPP_KINDS = {torch.ops.kvpp.wait.default: "wait", torch.ops.kvpp.wait: "wait",
              torch.ops.kvpp.prefetch.default: "prefetch", torch.ops.kvpp.prefetch: "prefetch"}


class KVPPGraphVerificationError(KVPPPassError):
    """A rewritten graph breaks one of the KVPP invariants."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        self.checks = {check for check, _ in problems}
        super().__init__("KVPP graph verification failed:\n  - "
                         + "\n  - ".join(f"[{check}] {message}" for check, message in problems))


class _RegisteredOps:
    """Registered specs matched by qualified name, each distinct target resolved once."""

    def __init__(self, specs: Iterable[AttentionOpSpec]) -> None:
        self.by_name = {spec.op: spec for spec in specs}
        self.cache: dict = {}

    def __call__(self, node: torch.fx.Node) -> AttentionOpSpec | None:
        if node.op != "call_function":
            return None
        target = getattr(node.target, "kvpp_routed_op", node.target)
        if target in self.cache:
            return self.cache[target]
        spec = None
        if isinstance(target, torch._ops.OpOverload):
            base = target._schema.name
            names = [f"{base}.{target._overloadname}", base]
        elif isinstance(target, torch._ops.OpOverloadPacket):
            names = [f"{target._qualified_op_name}.default", target._qualified_op_name]
        else:
            names = []
        for name in names:
            if name in self.by_name:
                spec = self.by_name[name]
                break
        self.cache[target] = spec
        return spec


def _kvpp_kind(node: torch.fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    try:
        return KVPP_KINDS.get(node.target)
    except TypeError:  # an unhashable target
        return None


def verify_graph(graph: torch.fx.Graph, table: LayerTable, pieces: Iterable = ()) -> None:
    problems: list[tuple[str, str]] = []
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    specs = registered_specs()
    match = _RegisteredOps(specs)
    plan = list(table.target_layers)
    plan_pos = {layer: k for k, layer in enumerate(plan)}
    drafts = set(table.draft_layers)

    waits: list[torch.fx.Node] = []
    prefetches: list[torch.fx.Node] = []
    kvpp_in_order: list[tuple[str, torch.fx.Node]] = []
    registered: list[tuple[torch.fx.Node, AttentionOpSpec, int]] = []
    for node in nodes:
        if node.op != "call_function":
            continue
        kind = _kvpp_kind(node)
        if kind is not None:
            (waits if kind == "wait" else prefetches).append(node)
            kvpp_in_order.append((kind, node))
        else:
            spec = match(node)
            if spec is None:
                continue
            try:
                layer = layer_of(node, spec, table.names or None)[0]
            except LayerResolutionError as exc:
                problems.append(("layers", str(exc)))
                continue
            if layer not in drafts:
                registered.append((node, spec, layer))

    # layers: kvpp ops and registered ops name target layers only
    for node in waits + prefetches:
        layer = node.args[0] if node.args else None
        if layer in drafts:
            problems.append(("layers", f"{node.name} is a kvpp op for draft layer {layer}, which is never broadcast."))
        elif layer not in plan_pos:
            problems.append(("layers", f"{node.name} is a kvpp op for layer {layer!r}, which is not a target "
                                       f"layer of the plan {plan}."))
    for node, _, layer in registered:
        if layer not in plan_pos:
            problems.append(("layers", f"{node.name} touches layer {layer}, which is neither a target nor a draft."))
    waits = [w for w in waits if w.args[0] in plan_pos]
    prefetches = [p for p in prefetches if p.args[0] in plan_pos]
    registered = [r for r in registered if r[2] in plan_pos]

    held = sorted({layer for _, _, layer in registered} | {w.args[0] for w in waits}, key=plan_pos.__getitem__)
    if held and [plan_pos[l] for l in held] != list(range(plan_pos[held[0]], plan_pos[held[-1]] + 1)):
        problems.append(("layers", f"the graph holds layers {held}, not a contiguous run of the plan {plan}."))

    # counts
    wait_of: dict[int, torch.fx.Node] = {}
    for layer in held:
        mine = [w for w in waits if w.args[0] == layer]
        if len(mine) != 1:
            problems.append(("counts", f"layer {layer} is awaited {len(mine)} times, expected once."))
        if mine:
            wait_of[layer] = mine[0]
    expected_prefetch = ([held[0]] if held and plan_pos[held[0]] == 0 else []) + \
        [plan[plan_pos[l] + 1] for l in held if plan_pos[l] + 1 < len(plan)]
    prefetched = [p.args[0] for p in prefetches]
    for layer in dict.fromkeys(expected_prefetch + prefetched):
        got, want = prefetched.count(layer), expected_prefetch.count(layer)
        if got != want:
            problems.append(("counts", f"layer {layer} is prefetched {got} times, expected {want}."))

    # slots
    for node in waits + prefetches:
        layer, slot = node.args[0], node.args[1]
        if slot != table.slot(layer):
            problems.append(("slots", f"{node.name} uses slot {slot!r} for layer {layer}; the plan's slot is "
                                      f"{table.slot(layer)}."))

    # outstanding: one prefetch in flight, each wait completes it
    pending = held[0] if held and plan_pos[held[0]] > 0 else None
    for kind, node in kvpp_in_order:
        if node.args[0] not in plan_pos:
            continue
        layer = node.args[0]
        if kind == "prefetch":
            if pending is not None:
                problems.append(("outstanding", f"{node.name} prefetches layer {layer} while layer {pending}'s "
                                                "prefetch is still outstanding."))
            pending = layer
        else:
            if pending != layer:
                problems.append(("outstanding", f"{node.name} waits for layer {layer}, but the outstanding "
                                                f"prefetch is {'none' if pending is None else f'layer {pending}'}."))
            pending = None

    # order
    for what, seq in (("prefetches", prefetched), ("waits", [w.args[0] for w in waits])):
        positions = [plan_pos[l] for l in seq]
        if positions != sorted(positions):
            problems.append(("order", f"the graph's {what} run over layers {seq}, not in the plan's order {plan}."))

    # slot_reuse: readers of each held layer's cache, then each prefetch against earlier layers on its slot
    readers: dict[int, list[torch.fx.Node]] = {layer: [] for layer in held}
    for layer, wait in wait_of.items():
        for user in wait.users:
            readers[layer].append(user)
            readers[layer].extend(user.users)
    for node, _, layer in registered:
        readers[layer].append(node)
    last_read = {layer: max((position[n] for n in ns), default=-1) for layer, ns in readers.items()}
    for prefetch in prefetches:
        layer = prefetch.args[0]
        slot = table.slot(layer)
        for earlier in held:
            if plan_pos[earlier] < plan_pos[layer] and table.slot(earlier) == slot \
                    and last_read[earlier] > position[prefetch]:
                late = sorted({n.name for n in readers[earlier] if position[n] > position[prefetch]})
                problems.append(("slot_reuse", f"{prefetch.name} refills slot {slot} for layer {layer} before the "
                                               f"last reader of layer {earlier} ({', '.join(late)})."))

    # components
    declared = {operand.component for spec in specs for operand in spec.cache_operands}
    for wait in waits:
        layer, caches, components = wait.args[0], wait.args[2], wait.args[3]
        valid = table.components.get(layer, declared) if table.components else declared
        if len(caches) != len(components):
            problems.append(("components", f"{wait.name} has {len(caches)} caches but {len(components)} names."))
        bad = [c for c in components if c not in valid]
        if bad or len(set(components)) != len(components):
            problems.append(("components", f"{wait.name} names components {list(components)}; layer {layer}'s "
                                           f"bundle has {sorted(valid)}, each at most once."))

    # binding
    for node, spec, layer in registered:
        wait = wait_of.get(layer)
        if wait is None:  # reported by counts
            continue
        if position[wait] > position[node]:
            problems.append(("binding", f"{node.name} touches layer {layer}'s cache before its wait."))
            continue
        names = list(wait.args[3])
        for operand in spec.cache_operands:
            value = get_arg(node, operand.arg)
            ok = (isinstance(value, torch.fx.Node) and value.op == "call_function"
                  and value.target is operator.getitem and value.args[0] is wait
                  and isinstance(value.args[1], int) and value.args[1] < len(names)
                  and names[value.args[1]] == operand.component)
            if not ok:
                problems.append(("binding", f"{node.name} reads layer {layer}'s {operand.component!r} cache from "
                                            f"{getattr(value, 'name', value)}, not from {wait.name}'s "
                                            f"{operand.component!r} output."))

    # originals
    originals = {c for wait in waits for c in wait.args[2] if isinstance(c, torch.fx.Node)}
    originals |= {n for n in nodes if n.op == "placeholder"
                  and is_kvpp_handle(n.meta.get("val", n.meta.get("example_value")))}
    for value in sorted(originals, key=position.__getitem__):
        for user in value.users:
            if _kvpp_kind(user) != "wait":
                problems.append(("originals", f"{user.name} reads the original cache value {value.name}; only "
                                              "kvpp.wait may read it."))
        layers_of_value = sorted({user.args[0] for user in value.users if _kvpp_kind(user) == "wait"})
        if len(layers_of_value) > 1:
            problems.append(("originals", f"the original cache value {value.name} is awaited as the cache of "
                                          f"layers {layers_of_value}; each layer's cache is its own."))

    # routing
    problems += [("routing", message) for message in _routing_problems(waits, registered, wait_of)]

    # pieces
    for piece in pieces:
        if piece.is_eager:
            continue
        bad = [n.name for n in piece.graph_module.graph.nodes if _kvpp_kind(n) or match(n) is not None]
        if bad:
            problems.append(("pieces", f"compiled piece {piece.name} contains kvpp or cache ops: {', '.join(bad)}."))

    if problems:
        raise KVPPGraphVerificationError(problems)


def _is_routed_wait(wait: torch.fx.Node) -> bool:
    return bool(wait.kwargs.get("routed", wait.args[4] if len(wait.args) > 4 else False))


def _routing_problems(waits: list[torch.fx.Node], registered: list[tuple[torch.fx.Node, AttentionOpSpec, int]],
                      wait_of: dict[int, torch.fx.Node]) -> list[str]:
    problems = []
    routed_waits = [w for w in waits if _is_routed_wait(w)]
    routed_ops = [node for node, _, _ in registered if is_routed_op(node.target)]
    if not routed_waits and not routed_ops:
        return problems
    if len(routed_waits) != len(waits):
        plain = [w.name for w in waits if not _is_routed_wait(w)]
        problems.append(f"waits {plain} are not routed while others are; owner mode is all or nothing per graph.")
    owner_run = {node: layer for node, _, layer in registered if is_routed_op(node.target)}
    for node, spec, layer in registered:
        target = node.target
        if not is_routed_op(target):
            problems.append(f"{node.name} touches layer {layer}'s cache without routing in a routed graph; in owner "
                            "mode it would read a scratch slot that is not filled.")
            continue
        if target.layer != layer:
            problems.append(f"{node.name} is routed for layer {target.layer} but touches layer {layer}.")
        wait = wait_of.get(layer)
        if wait is not None and not _is_routed_wait(wait):
            problems.append(f"{node.name} is routed but its layer's wait {wait.name} is not.")
        rule = spec.owner
        if isinstance(rule, OwnerLocal):
            if target.heads:
                problems.append(f"{node.name} is routed as head-separable, but {spec.op} is declared OwnerLocal.")
            for user in node.users:
                if owner_run.get(user) != layer:
                    problems.append(f"{user.name} reads the owner-local output of {node.name}, which is None on the "
                                    f"ranks that do not own layer {layer}.")
                elif any(_arg_at(user, where) is node for where, _ in user.target.heads):
                    problems.append(f"{user.name} takes the owner-local output of {node.name} as a head operand.")
        elif isinstance(rule, HeadSeparable):
            try:
                declared = tuple((arg_location(node, o.arg), o.dim) for o in rule.operands)
            except LayerResolutionError as exc:
                problems.append(f"{node.name}: {exc}")
                continue
            tokens = tuple(o.token_dim for o in rule.operands)
            if (target.heads, target.output_dim, target.output_like, target.token_dims) != \
                    (declared, rule.output_dim, rule.output_like, tokens):
                problems.append(f"{node.name} is routed with heads {target.heads}, output dimension "
                                f"{target.output_dim}, output like {target.output_like}, token dimensions "
                                f"{target.token_dims}; {spec.op} declares {declared}, {rule.output_dim}, "
                                f"{rule.output_like}, {tokens}.")
        else:
            problems.append(f"{node.name} is routed, but {spec.op} declares no owner rule.")
    return problems


def _arg_at(node: torch.fx.Node, where: int | str):
    if isinstance(where, str):
        return node.kwargs.get(where)
    return node.args[where] if where < len(node.args) else None
