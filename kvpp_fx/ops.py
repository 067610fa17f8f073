"""The KVPP graph ops' schemas, registered with torch.library in the ``kvpp`` namespace (`kvpp_fx.schedule`
names them):

    kvpp::prefetch(int layer, int slot) -> ()
    kvpp::wait(int layer, int slot, Tensor[] caches, str[] components, bool routed=False,
               Tensor[]? tables=None, str[]? table_kinds=None) -> Tensor[]
    kvpp::enter_layer(SymInt layer, Tensor[] caches, str[] components, Tensor[]? tables=None,
                      str[]? table_kinds=None) -> Tensor[]

``wait`` takes the cache tensors the graph had for the layer before the rewrite (one per cache
component its attention/cache ops read) and returns, in the same order, the views those ops must read
instead: persistent on the owner rank, the layer's scratch slot elsewhere. The component names let the
runtime pick the right typed view of the layer's bundle (an SFA layer has the latent cache, the
indexer keys and their scales). After the views come the layer's block tables and slot mappings
(``tables``, each of a ``table_kinds`` kind), as the ops must read them: remapped to the packed slot
where the rank reads the layer from one, unchanged elsewhere. ``routed=True`` says the layer's cache ops
were routed for owner mode; a wait without it refuses an owner-mode forward. See docs/graph-contract.md.

``enter_layer`` serves a graph that Dynamo compiled once for several layers, whose layer index is a
run-time value (a graph input): it runs the schedule's entry for that layer when it is called and
returns the views as ``wait`` does; for a local draft layer it returns the caches it was given.

This module holds what the compiler needs: the schemas, the fake implementations (shapes for tracing),
the ops' effects, and the one matcher of kvpp ops and routed ops (`kvpp_op_kind`, `routed_op_of`). The
implementations, which call the runtime, and `RoutedOp` live with the runtime
(`kvpp_fx.runtime.graph_ops`). All three ops are registered as ORDERED-effectful, so fx dead-code
elimination, AOTAutograd and inductor keep them (AOT threads effect tokens through them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._library.effects import EffectType

from kvpp_fx.schedule import ENTER_LAYER, NAMESPACE, OP_SCHEMAS, PREFETCH, WAIT

LIBRARY = torch.library.Library(NAMESPACE, "DEF")
for _schema in OP_SCHEMAS.values():
    LIBRARY.define(_schema)


@torch.library.register_fake(f"{NAMESPACE}::{PREFETCH}", lib=LIBRARY)
def _prefetch_fake(layer: int, slot: int) -> None:
    return None


def _contiguous(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # The real cache outputs are contiguous views of the runtime's storage, and remapped tables are new
    # contiguous tensors, whatever the inputs' strides.
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]


@torch.library.register_fake(f"{NAMESPACE}::{WAIT}", lib=LIBRARY)
def _wait_fake(layer: int, slot: int, caches: list[torch.Tensor], components: list[str],
               routed: bool = False, tables: list[torch.Tensor] | None = None,
               table_kinds: list[str] | None = None) -> list[torch.Tensor]:
    return _contiguous([*caches, *(tables or ())])


@torch.library.register_fake(f"{NAMESPACE}::{ENTER_LAYER}", lib=LIBRARY)
def _enter_layer_fake(layer: int, caches: list[torch.Tensor], components: list[str],
                      tables: list[torch.Tensor] | None = None,
                      table_kinds: list[str] | None = None) -> list[torch.Tensor]:
    return _contiguous([*caches, *(tables or ())])


# torch 2.13 has no public effect registration for ops defined with `torch.library.Library`: the public
# route, `CustomOpDef.register_effect`, needs `torch.library.custom_op`, whose outputs may not alias
# inputs, and `wait` returns its inputs under passthrough. Hence the private call, here only.
for _op in OP_SCHEMAS:
    torch.library._register_effectful_op(f"{NAMESPACE}::{_op}", EffectType.ORDERED)

prefetch = torch.ops.kvpp.prefetch
wait = torch.ops.kvpp.wait
enter_layer = torch.ops.kvpp.enter_layer

KVPP_OPS = (prefetch, wait, enter_layer)
# Dynamo graphs hold the packet (``torch.ops.kvpp.wait``), graphs after AOT the overload (``.default``).
_KINDS = {target: kind for op, kind in zip(KVPP_OPS, (PREFETCH, WAIT, ENTER_LAYER))
          for target in (op, op.default)}

# The attribute a routed op carries: the registered cache op it routes (`kvpp_fx.runtime.graph_ops.RoutedOp`).
ROUTED_ATTRIBUTE = "kvpp_routed_op"


def kvpp_op_kind(target: object) -> str | None:
    """`PREFETCH`, `WAIT` or `ENTER_LAYER` for a kvpp op's graph target; None for anything else."""
    try:
        return _KINDS.get(target)
    except TypeError:  # an unhashable target
        return None


def is_kvpp_op(target: object) -> bool:
    return kvpp_op_kind(target) is not None


def kvpp_nodes(graph: Any, *kinds: str) -> list[Any]:
    """The graph's kvpp op nodes (of `kinds`, default every kind), in graph order, from fx's index of its
    nodes by target rather than a walk over every node."""
    wanted = [target for target, kind in _KINDS.items() if not kinds or kind in kinds]
    found = [node for target in wanted for node in graph.find_nodes(op="call_function", target=target, sort=False)]
    order = {node: i for i, node in enumerate(graph.nodes)} if len(found) > 1 else {}
    return sorted(found, key=order.__getitem__) if order else found


def routed_op_of(target: object) -> Any:
    """The registered op a routed graph target routes, or None for any other target."""
    return getattr(target, ROUTED_ATTRIBUTE, None)


def is_routed_op(target: object) -> bool:
    return routed_op_of(target) is not None
