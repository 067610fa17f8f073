"""The verifier's checks that each layer's ops read what its wait (or enter) hands back
(`verify.CHECKS`): ``components``, ``binding``, ``tables``, ``originals`` and ``run_time_layer``.

Invariant: each check is a function of the `GraphFacts` alone that yields one message per problem.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
import torch.fx

from kvpp_fx.passes.pass_config import is_kvpp_handle, node_value
from kvpp_fx.passes.registry import get_arg
from kvpp_fx.passes.verify_facts import GraphFacts, is_output_for, kvpp_kind, tables_of
from kvpp_fx.schedule import ENTER_LAYER, WAIT


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
            if not is_output_for(value, wait, names, operand.component):
                yield (f"{node.name} reads layer {layer}'s {operand.component!r} cache from "
                       f"{getattr(value, 'name', value)}, not from {wait.name}'s {operand.component!r} output.")


def check_tables(g: GraphFacts) -> Iterator[str]:
    ops = [(op, g.wait_of.get(op.layer)) for op in g.registered]
    if g.enters:
        ops += [(op, g.enters[0]) for op in g.run_time_ops]
    for op, source in ops:
        if source is None or g.position[source] > g.position[op.node]:  # reported by binding
            continue
        caches = source.args[2] if kvpp_kind(source) == WAIT else source.args[1]
        tables, kinds = tables_of(source)
        for operand in op.spec.tables:
            read = get_arg(op.node, operand.arg)
            if not isinstance(read, torch.fx.Node):
                continue
            index = (read.args[1] - len(caches) if read.op == "call_function" and read.target is operator.getitem
                     and read.args[0] is source and isinstance(read.args[1], int) else -1)
            if not 0 <= index < len(tables) or kinds[index] != operand.kind:
                yield (f"{op.node.name} reads its {operand.kind} from {read.name}, not from {source.name}'s "
                       f"{operand.kind} output: a rank reading a packed scratch slot would read it unremapped.")


def check_originals(g: GraphFacts) -> Iterator[str]:
    originals = {c for wait in g.waits for c in wait.args[2] if isinstance(c, torch.fx.Node)}
    originals |= {c for enter in g.enters for c in enter.args[1] if isinstance(c, torch.fx.Node)}
    originals |= {n for n in g.nodes if n.op == "placeholder" and is_kvpp_handle(node_value(n))}
    for value in sorted(originals, key=g.position.__getitem__):
        for user in value.users:
            if kvpp_kind(user) not in (WAIT, ENTER_LAYER):
                yield (f"{user.name} reads the original cache value {value.name}; only kvpp.wait (or "
                       "kvpp.enter_layer) may read it.")
        layers_of_value = sorted({user.args[0] for user in value.users if kvpp_kind(user) == WAIT})
        if len(layers_of_value) > 1:
            yield (f"the original cache value {value.name} is awaited as the cache of layers {layers_of_value}; "
                   "each layer's cache is its own.")


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
    value = node_value(source) if isinstance(source, torch.fx.Node) else None
    if not isinstance(value, torch.SymInt):
        yield f"{enter.name} names layer {getattr(source, 'name', source)!r}, which is not a run-time value."
    declared = {operand.component for spec in g.specs for operand in spec.cache_operands}
    if len(enter.args[1]) != len(names) or any(c not in declared for c in names) or len(set(names)) != len(names):
        yield f"{enter.name} names components {names} for {len(enter.args[1])} caches; declared: {sorted(declared)}."
    for op in g.run_time_ops:
        node = op.node
        if op.source is not source:
            yield f"{node.name} reads its layer from {op.source.name}, but {enter.name} enters the layer {source}."
        if g.position[enter] > g.position[node]:
            yield f"{node.name} touches the layer's cache before {enter.name}."
            continue
        for operand in op.spec.cache_operands:
            read = get_arg(node, operand.arg)
            if not is_output_for(read, enter, names, operand.component):
                yield (f"{node.name} reads its {operand.component!r} cache from {getattr(read, 'name', read)}, not "
                       f"from {enter.name}'s {operand.component!r} output.")
