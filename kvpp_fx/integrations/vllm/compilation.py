"""vLLM's compiled path: the Dynamo backend ``kvpp_fx.integrations.vllm.backend``.

Used as ``compilation_config={"mode": 2, "backend": "kvpp_fx.integrations.vllm.backend"}`` (mode 1
works the same way) with ``VLLM_USE_AOT_COMPILE=0``. vLLM hands it each whole Dynamo graph it
compiles. Invariant: a graph of the target model gets the engine plan's kvpp ops (the layer table is
the plan's, so slots agree with the eager path and the runtime); a graph holding only MTP layers (the
drafter's) gets none, since drafts stay local. The graph is then split at the kvpp and MLA ops and
each other piece is compiled by ``$KVPP_VLLM_INNER`` (default ``inductor``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch.fx

from kvpp_fx.backend import KVPPBackend
from kvpp_fx.integrations.vllm.state import current_engine
from kvpp_fx.passes.layer_table import LayerTable
from kvpp_fx.passes.registry import find_spec, layer_of

logger = logging.getLogger(__name__)

INNER_ENV = "KVPP_VLLM_INNER"

KVPP_SPLITTING_OPS = ("kvpp::prefetch", "kvpp::wait")


class KVPPCompileError(RuntimeError):
    """The kvpp backend cannot tell which engine's plan a graph belongs to."""


def splitting_ops(existing: Iterable[str]) -> list[str]:
    """``splitting_ops`` plus the kvpp ops (kept in order, no duplicates)."""
    ops = list(existing)
    return ops + [op for op in KVPP_SPLITTING_OPS if op not in ops]


def graph_layers(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Name -> index of every layer the graph's registered MLA/SFA ops name."""
    names = {}
    for node in gm.graph.nodes:
        spec = find_spec(node)
        if spec is not None:
            index, name = layer_of(node, spec)
            names[name] = index
    return names


def layer_table_for(names: dict[str, int], plan: Any | None, plan_names: dict[str, int] | None = None) -> LayerTable:
    """The table the pass uses for a graph reading the layers `names`, under an engine's plan (None:
    KVPP off). Layer names come from graph inputs, which Dynamo does not guard, so the table always
    carries the name map."""
    layers = tuple(sorted(set(names.values())))
    if plan is None:
        return LayerTable(target_layers=(), draft_layers=layers, names=names)
    if layers and set(layers) <= set(plan.local_draft_layers):
        return LayerTable(target_layers=(), draft_layers=layers, depth=plan.depth, names=plan_names or names)
    unknown = sorted(set(layers) - set(plan.target_layers) - set(plan.local_draft_layers))
    if unknown:
        raise KVPPCompileError(f"the graph reads layers {unknown}, which the KVPP plan does not hold.")
    return LayerTable.from_plan(plan, plan_names)


def kvpp_vllm_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]):
    state = current_engine()
    if state is None:
        _refuse_if_kvpp_on()
    plan = None if state is None else state.plan
    if state is not None and plan is None:
        raise KVPPCompileError("the kvpp backend compiled a graph before the engine's KVPP plan was built.")
    names = graph_layers(gm)
    layers = tuple(sorted(set(names.values())))
    table = layer_table_for(names, plan, dict(state.vplan.layer_index) if plan is not None else None)
    inner = os.environ.get(INNER_ENV, "inductor")
    kind = "target" if table.target_layers else ("draft" if state is not None else "kvpp-off")
    logger.info("KVPP: %s graph with layers %s, kvpp ops for %s, pieces compiled by %s.", kind, list(layers),
                list(table.target_layers), inner)
    compiled = KVPPBackend(table, mode="piecewise", inner=inner)(gm, example_inputs)
    if state is not None:
        state.compiled_graphs.append((kind, layers))
    return compiled


def _refuse_if_kvpp_on() -> None:
    """No engine is running: fine with KVPP off (the graph gets no kvpp ops); a bug with KVPP on."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return
    from kvpp_fx.config import KVPPConfig

    config = get_current_vllm_config_or_none()
    if config is not None and KVPPConfig.from_vllm_config(config).enabled:
        raise KVPPCompileError("the kvpp backend compiled a graph outside a KVPP model runner's step; "
                               "no kvpp op would be placed.")
