"""What a vLLM PIECEWISE deployment needs from kvpp-fx: the ops to split the graph at."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch.fx

from kvpp_fx.backend import KVPPBackend
from kvpp_fx.passes.layer_table import LayerTable
from kvpp_fx.passes.registry import find_spec, layer_of

logger = logging.getLogger(__name__)

INNER_ENV = "KVPP_VLLM_INNER"

# The layers of every graph this process rewrote, for `worker.worker_stats`.
REWRITTEN_GRAPHS: list[tuple[int, ...]] = []

KVPP_SPLITTING_OPS = ("kvpp::prefetch", "kvpp::wait")


def splitting_ops(existing: Iterable[str]) -> list[str]:
    """vLLM's ``compilation_config.splitting_ops`` plus the kvpp ops (kept in order, no duplicates).

    Next to the attention ops, the kvpp ops must run eagerly between compiled pieces: a compiled or
    CUDA-graph-captured piece would freeze the broadcast and the rebinding.
    """
    ops = list(existing)
    return ops + [op for op in KVPP_SPLITTING_OPS if op not in ops]


def layer_table_from_graph(gm: torch.fx.GraphModule) -> LayerTable:
    """The target layers of a vLLM graph: every layer its registered MLA ops name, in index order."""
    layers = set()
    for node in gm.graph.nodes:
        spec = find_spec(node)
        if spec is not None:
            layers.add(layer_of(node, spec)[0])
    return LayerTable(target_layers=tuple(sorted(layers)))


def kvpp_vllm_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]):
    """``compilation_config={"mode": 2, "backend": "kvpp_fx.integrations.vllm.backend"}``.

    vLLM hands the whole Dynamo graph here. The KVPP pass rewrites it, the graph is split at the kvpp
    and MLA ops (inductor would otherwise reorder the effectful kvpp ops), and each compiled piece
    goes to the inner backend: ``$KVPP_VLLM_INNER`` (default ``inductor``).
    """
    from kvpp_fx.integrations.vllm.worker import STATE

    if STATE.config is None:
        raise RuntimeError("the kvpp vLLM backend compiled a graph before the worker hooks read the config; "
                           "is the kvpp_fx plugin loaded (vllm.general_plugins)?")
    table = layer_table_from_graph(gm)
    if not STATE.config.enabled:
        # KVPP off: every layer is local, so no kvpp op is inserted; the split and the inner compiler
        # stay the same, which keeps on/off runs comparable.
        table = LayerTable(target_layers=(), draft_layers=table.target_layers)
    inner = os.environ.get(INNER_ENV, "inductor")
    logger.info("KVPP: rewriting vLLM's graph for layers %s, pieces compiled by %s.", list(table.target_layers), inner)
    compiled = KVPPBackend(table, mode="piecewise", inner=inner)(gm, example_inputs)
    REWRITTEN_GRAPHS.append(table.target_layers)
    return compiled
