"""Split a rewritten graph into pieces for PIECEWISE execution (vLLM's ``split_graph`` semantics).

Invariant: every kvpp op and every registered attention/cache op (a node the insert pass stamped as
one) lands in an *eager* piece, and every other computation in a *compiled* piece. Consecutive split
points share one eager piece; a ``getitem`` stays in the piece of the value it unpacks; pieces keep the
graph's original order. Cache tensors are therefore only ever touched by code that runs eagerly, never
functionalized or copied by a compiler.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from kvpp_fx.ops import is_kvpp_op
from kvpp_fx.passes.pass_config import cache_op_stamp


@dataclass(frozen=True)
class Piece:
    name: str          # attribute name of the submodule in the split module ("submod_3")
    index: int
    is_eager: bool
    graph_module: torch.fx.GraphModule

    @property
    def kind(self) -> str:
        return "eager" if self.is_eager else "compiled"


@dataclass(frozen=True)
class SplitResult:
    split_gm: torch.fx.GraphModule
    pieces: tuple[Piece, ...]
    timings: dict[str, float] = field(default_factory=dict, compare=False)  # assign_s, split_module_s


def is_split_point(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (is_kvpp_op(node.target) or cache_op_stamp(node) is not None)


def assign_pieces(graph: torch.fx.Graph) -> tuple[dict[torch.fx.Node, int], dict[int, bool]]:
    """Node -> piece index, and piece index -> is_eager."""
    piece_of: dict[torch.fx.Node, int] = {}
    eager: dict[int, bool] = {}
    current, current_eager = -1, None
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and \
                isinstance(node.args[0], torch.fx.Node) and node.args[0] in piece_of:
            piece_of[node] = piece_of[node.args[0]]
            continue
        split = is_split_point(node)
        if split is not current_eager:
            current += 1
            current_eager = split
            eager[current] = split
        piece_of[node] = current
    return piece_of, eager


def split_pieces(gm: torch.fx.GraphModule) -> SplitResult:
    """The pieces of `gm` (left as it is). The split needs no configuration: the stamps say which nodes
    are registered ops."""
    t0 = time.perf_counter()
    piece_of, eager = assign_pieces(gm.graph)
    t1 = time.perf_counter()
    split_gm = split_module(gm, None, lambda node: piece_of[node], keep_original_order=True)
    t2 = time.perf_counter()
    pieces = []
    for name, module in split_gm.named_children():
        if not name.startswith("submod_"):
            continue
        index = int(name.removeprefix("submod_"))
        pieces.append(Piece(name, index, eager[index], module))
    pieces.sort(key=lambda p: p.index)
    return SplitResult(split_gm, tuple(pieces), {"assign_s": t1 - t0, "split_module_s": t2 - t1})
