"""Route each layer's registered cache ops for owner mode, so one graph serves both modes.

Runs after the insert pass, and reads its stamps (each registered op's layer and spec): it resolves
nothing again. When every registered cache op of every layer the graph awaits declares an
owner rule (`HeadSeparable`, `OwnerLocal` or `RoutesItself` in its `AttentionOpSpec`), each node of the
first two kinds gets as its target a routed op (the runtime's `RoutedOp`, which the caller hands the
pass) that carries the op, the layer and the
resolved head operands, a `RoutesItself` node stays as it is (its implementation exchanges its own owner
rows), and each wait gets ``routed=True``. Otherwise the graph is left as it is and serves broadcast mode only: the
runtime
refuses owner mode at its first wait (`OwnerModeUnsupportedError`), before any byte moves.

Invariants after the pass, for a routed graph:
- every registered op of a target layer is a `RoutedOp` of that layer or declared `RoutesItself`, and
  every wait is routed;
- every head operand of a head-separable op is a tensor whose declared head dimension has the same
  size as the other head operands' (the rank's heads), and so has the output's;
- the output of an owner-local op (None on the ranks that do not own the layer) is read only by routed
  ops of the same layer, never as a head operand; otherwise `OwnerLocalOutputError`.
A graph with some declared and some undeclared ops is not routed at all, so owner mode is all or
nothing per graph. Running the pass again changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from kvpp_fx.ops import is_routed_op, kvpp_nodes
from kvpp_fx.passes.pass_config import KVPPPassError, PassConfig, cache_op_stamp, node_value
from kvpp_fx.schedule import WAIT
from kvpp_fx.passes.registry import (
    AttentionOpSpec,
    HeadSeparable,
    LayerResolutionError,
    OwnerLocal,
    RoutesItself,
    arg_location,
    get_arg,
)

logger = logging.getLogger(__name__)


class OwnerLocalOutputError(KVPPPassError):
    """An owner-local op's output reaches a node that would run on ranks that do not compute it."""


class HeadOperandError(KVPPPassError):
    """A head-separable op's declared head operands are missing or do not split heads consistently."""


@dataclass(frozen=True)
class RouteResult:
    routed: bool
    reason: str = ""  # why a graph with layers was not routed


def resolve_heads(node: torch.fx.Node, rule: HeadSeparable) -> tuple[tuple[int | str, int], ...]:
    """(location, dim) of each declared head operand in this call, checked against the metadata: one
    head count and one dtype over the head operands, and an output shaped like the ``output_like``
    operand with its heads on the same dimension."""
    heads, vals = [], []
    for operand in rule.operands:
        try:
            where = arg_location(node, operand.arg)
        except LayerResolutionError as exc:
            raise HeadOperandError(f"{node.format_node()}: declared head operand {operand.arg!r} is not "
                                   f"passed: {exc}") from None
        value = get_arg(node, operand.arg)
        if not isinstance(value, torch.fx.Node):
            raise HeadOperandError(f"{node.format_node()}: head operand {operand.arg!r} is not a graph value.")
        val = node_value(value)
        if isinstance(val, torch.Tensor):
            for what, dim in (("head", operand.dim), ("token", operand.token_dim)):
                if not -val.dim() <= dim < val.dim():
                    raise HeadOperandError(f"{node.format_node()}: head operand {operand.arg!r} has {val.dim()} "
                                           f"dimensions, the declaration names {what} dimension {dim}.")
        vals.append(val)
        heads.append((where, operand.dim))
    known = [(v, o) for v, o in zip(vals, rule.operands) if isinstance(v, torch.Tensor)]
    sizes = [v.shape[o.dim] for v, o in known]
    out = node_value(node)
    like, like_operand = vals[rule.output_like], rule.operands[rule.output_like]
    if isinstance(like, torch.Tensor) and out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != like.dtype:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise HeadOperandError(f"{node.format_node()}: the output is {got}; the declaration says it is shaped "
                                   f"like head operand {rule.output_like} ({tuple(like.shape)} {like.dtype}).")
        if rule.output_dim % like.dim() != like_operand.dim % like.dim():
            raise HeadOperandError(f"{node.format_node()}: the output's head dimension {rule.output_dim} is not "
                                   f"that of head operand {rule.output_like} ({like_operand.dim}), whose shape it has.")
    if len({str(s) for s in sizes}) > 1:
        raise HeadOperandError(f"{node.format_node()}: the head operands disagree on the number of heads "
                               f"({sizes}); a head-separable op's head dimensions must all hold the rank's heads.")
    if len({v.dtype for v, _ in known}) > 1:
        dtypes = sorted(str(v.dtype) for v, _ in known)
        raise HeadOperandError(f"{node.format_node()}: head operands of dtypes {dtypes}; "
                               "owner mode packs them into one buffer of one dtype.")
    return tuple(heads)


def route_owner_ops(gm: torch.fx.GraphModule, config: PassConfig,
                    routed_op: Callable[..., Any]) -> RouteResult:
    """Route `gm`'s graph in place (see the module docstring); the caller regenerates ``gm.code``.
    ``routed_op(op, layer, heads=(), output_dim=None, output_like=0, token_dims=None, rows=None)`` makes
    the graph target of a routed op."""
    graph = gm.graph
    waits = {n.args[0]: n for n in kvpp_nodes(graph, WAIT)}
    if not waits:
        return RouteResult(False, "no kvpp.wait in the graph")
    if any(is_routed_op(n.target) for n in graph.nodes if n.op == "call_function"):
        return RouteResult(True)
    layers = _stamped_layers(graph, config)
    unstamped = sorted(set(waits) - set(layers))
    if unstamped:
        reason = f"layers {unstamped} are awaited but none of their ops carries the insert pass's stamp"
        logger.info("kvpp route pass: graph left in broadcast-only form (%s)", reason)
        return RouteResult(False, reason)
    undeclared = sorted({spec.op for ops in layers.values() for _, spec in ops if spec.owner is None})
    if undeclared:
        reason = f"ops without an owner rule: {undeclared}"
        logger.info("kvpp route pass: graph left in broadcast-only form (%s)", reason)
        return RouteResult(False, reason)

    routes: list[tuple[torch.fx.Node, Any]] = []
    for layer, ops in layers.items():
        members = {node for node, _ in ops}
        head_positions = {node: _head_values(node, spec) for node, spec in ops}
        for node, spec in ops:
            if isinstance(spec.owner, RoutesItself):
                continue  # its implementation exchanges its own owner rows; the node stays as it is
            if isinstance(spec.owner, OwnerLocal):
                for user in node.users:
                    if user not in members or node in head_positions[user]:
                        raise OwnerLocalOutputError(
                            f"{node.format_node()} is owner-local (in owner mode it runs on layer {layer}'s "
                            f"owner only and gives None elsewhere), but {user.format_node()} reads its output"
                            + (" as a head operand" if user in members else
                               ", which is not a routed cache op of the same layer")
                            + ". Declare the op HeadSeparable, or keep its output inside the layer's cache ops.")
                routes.append((node, routed_op(node.target, layer)))
            else:
                heads = resolve_heads(node, spec.owner)
                routes.append((node, routed_op(node.target, layer, heads, spec.owner.output_dim,
                                              spec.owner.output_like,
                                              tuple(o.token_dim for o in spec.owner.operands), spec.owner.rows)))
    for node, routed in routes:
        node.target = routed
    for wait in waits.values():
        wait.update_kwarg("routed", True)
    return RouteResult(True)


def _stamped_layers(graph: torch.fx.Graph,
                    config: PassConfig) -> dict[int, list[tuple[torch.fx.Node, AttentionOpSpec]]]:
    """The target layers' registered ops, as the insert pass stamped them, in graph order."""
    targets = set(config.schedule.target_layers)
    layers: dict[int, list[tuple[torch.fx.Node, AttentionOpSpec]]] = {}
    for node in graph.nodes:
        found = cache_op_stamp(node)
        if found is not None and found.layer in targets:
            layers.setdefault(found.layer, []).append((node, found.spec))
    return layers


def _head_values(node: torch.fx.Node, spec: AttentionOpSpec) -> set[torch.fx.Node]:
    if not isinstance(spec.owner, HeadSeparable):
        return set()
    values = set()
    for operand in spec.owner.operands:
        try:
            value = get_arg(node, operand.arg)
        except LayerResolutionError:
            continue
        if isinstance(value, torch.fx.Node):
            values.add(value)
    return values
