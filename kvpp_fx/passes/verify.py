"""Verify a rewritten (and optionally split) graph. Run after the other passes.

Invariants checked, each reported with the offending nodes:
1. every cache-touching node of a target layer comes after that layer's wait, and each of its cache
   operands is a view produced by that wait;
2. every layer is prefetched once and awaited once, and its prefetch comes before its wait;
3. a slot is never prefetched again before the last reader of the layer that used it before;
4. no compiled piece contains a kvpp op or a cache-touching op.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx

from kvpp_fx.ops import is_kvpp_op
from kvpp_fx.passes.insert import KVPPPassError, collect_layers
from kvpp_fx.passes.layer_table import LayerTable
from kvpp_fx.passes.registry import get_arg
from kvpp_fx.passes.split import Piece, is_split_point


class KVPPGraphVerificationError(KVPPPassError):
    """A rewritten graph breaks one of the KVPP invariants."""


def _op_name(node: torch.fx.Node) -> str | None:
    if node.op != "call_function" or not is_kvpp_op(node.target):
        return None
    return "wait" if "wait" in str(node.target) else "prefetch"


def verify_graph(graph: torch.fx.Graph, table: LayerTable, pieces: Iterable[Piece] = ()) -> None:
    problems: list[str] = []
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    prefetch_at: dict[int, list[int]] = {}
    wait_node: dict[int, torch.fx.Node] = {}
    wait_count: dict[int, int] = {}
    readers: dict[int, list[int]] = {}

    for node in nodes:
        kind = _op_name(node)
        if kind == "prefetch":
            prefetch_at.setdefault(node.args[0], []).append(position[node])
        elif kind == "wait":
            layer = node.args[0]
            wait_count[layer] = wait_count.get(layer, 0) + 1
            wait_node.setdefault(layer, node)
            for user in node.users:  # views, then whatever reads them
                readers.setdefault(layer, []).extend(position[u] for u in user.users)

    for group in collect_layers(graph, table):
        layer = group.layer
        wait = wait_node.get(layer)
        for node, spec in zip(group.nodes, group.specs):
            readers.setdefault(layer, []).append(position[node])
            if wait is None or position[wait] > position[node]:
                problems.append(f"{node.name} touches layer {layer}'s cache before (or without) its wait.")
                continue
            for operand in spec.cache_operands:
                value = get_arg(node, operand.arg)
                if not (isinstance(value, torch.fx.Node) and value.target is operator.getitem
                        and value.args[0] is wait):
                    problems.append(f"{node.name} reads layer {layer}'s {operand.component!r} cache from "
                                    f"{getattr(value, 'name', value)}, not from its wait.")

    for layer in table.target_layers:
        prefetches = prefetch_at.get(layer, [])
        if layer not in wait_node:
            if prefetches or readers.get(layer):
                problems.append(f"layer {layer} has no wait.")
            continue
        if wait_count[layer] != 1:
            problems.append(f"layer {layer} is awaited {wait_count[layer]} times.")
        if len(prefetches) != 1:
            problems.append(f"layer {layer} is prefetched {len(prefetches)} times.")
        elif prefetches[0] > position[wait_node[layer]]:
            problems.append(f"layer {layer}'s prefetch comes after its wait.")

    # 3: slot reuse. The previous layer on a slot must have no reader after the next prefetch there.
    by_slot: dict[int, list[int]] = {}
    for layer in table.target_layers:
        if layer in prefetch_at:
            by_slot.setdefault(table.slot(layer), []).append(layer)
    for slot, layers in by_slot.items():
        ordered = sorted(layers, key=lambda l: prefetch_at[l][0])
        for prev, nxt in zip(ordered, ordered[1:]):
            reuse = prefetch_at[nxt][0]
            late = [nodes[i].name for i in readers.get(prev, []) if i > reuse]
            if late:
                problems.append(f"slot {slot} is prefetched for layer {nxt} before the last reader of layer "
                                f"{prev} ({', '.join(late)}).")

    for piece in pieces:
        if piece.is_eager:
            continue
        bad = [n.name for n in piece.graph_module.graph.nodes if is_split_point(n)]
        if bad:
            problems.append(f"compiled piece {piece.name} contains kvpp or cache ops: {', '.join(bad)}.")

    if problems:
        raise KVPPGraphVerificationError("KVPP graph verification failed:\n  - " + "\n  - ".join(problems))
