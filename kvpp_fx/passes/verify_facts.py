"""What the verifier reads from a rewritten graph, in one walk, for its checks (`verify`).

Invariant: the facts hold the graph as it stands after the passes, never what a pass meant to write:
the kvpp ops are found by their overloads, the registered ops with the configuration's `OpMatcher`, and
their layers come from the compile's one reading (`kvpp_fx.passes.layers`) only for ops that still pass
the layer argument that reading saw; an op a pass added or changed is read again. No stamp is trusted.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx

from kvpp_fx.arguments import read_arg
from kvpp_fx.ops import kvpp_op_kind
from kvpp_fx.passes.layers import GraphLayers, ResolvedOp
from kvpp_fx.passes.pass_config import PassConfig
from kvpp_fx.passes.registry import AttentionOpSpec, OpMatcher
from kvpp_fx.schedule import ENTER_LAYER, WAIT, LayerSchedule, ScheduleStep


def kvpp_kind(node: torch.fx.Node) -> str | None:
    return kvpp_op_kind(node.target) if node.op == "call_function" else None


def is_routed_wait(wait: torch.fx.Node) -> bool:
    return bool(read_arg(wait.args, wait.kwargs, ("routed", 4)))


def tables_of(node: torch.fx.Node) -> tuple[list, list]:
    """A wait's or enter's ``tables`` and ``table_kinds`` (keywords, or the trailing positionals)."""
    first = 5 if kvpp_kind(node) == WAIT else 3
    tables = read_arg(node.args, node.kwargs, ("tables", first)) or []
    kinds = read_arg(node.args, node.kwargs, ("table_kinds", first + 1)) or []
    return list(tables), list(kinds)


def is_output_for(value: object, op: torch.fx.Node, names: list[str], component: str) -> bool:
    """Whether `value` is the output of a wait or enter `op` for `component` (a ``getitem`` of it)."""
    return (isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target is operator.getitem
            and value.args[0] is op and isinstance(value.args[1], int) and value.args[1] < len(names)
            and names[value.args[1]] == component)


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
    all_registered: list[ResolvedOp]
    kvpp_in_order: list[tuple[str, torch.fx.Node]]
    waits: list[torch.fx.Node]
    prefetches: list[torch.fx.Node]
    registered: list[ResolvedOp]
    held: list[int]  # the target layers the graph holds, in plan order
    wait_of: dict[int, torch.fx.Node]  # each held layer's (first) wait
    expected: tuple[ScheduleStep, ...]  # the plan's schedule for the held layers
    pieces: tuple
    enters: list[torch.fx.Node]
    run_time_ops: list[ResolvedOp]  # registered ops whose layer a run-time value (their ``source``) names

    @classmethod
    def read(cls, graph: torch.fx.Graph, config: PassConfig, pieces: Iterable, layers: GraphLayers) -> GraphFacts:
        schedule = config.schedule
        nodes = list(graph.nodes)
        drafts = set(schedule.draft_layers)
        unresolved: list[str] = []
        waits: list[torch.fx.Node] = []
        prefetches: list[torch.fx.Node] = []
        kvpp_in_order: list[tuple[str, torch.fx.Node]] = []
        registered: list[ResolvedOp] = []
        enters: list[torch.fx.Node] = []
        run_time_ops: list[ResolvedOp] = []
        for node in nodes:
            if node.op != "call_function":
                continue
            kind = kvpp_kind(node)
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
            op = layers.current(node, spec)
            if op.error is not None:
                unresolved.append(str(op.error))
            elif op.source is not None:
                run_time_ops.append(op)
            elif op.layer not in drafts:
                registered.append(op)
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
