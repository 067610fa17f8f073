"""Verify a rewritten (and optionally split) graph on its own. Run after the other passes.

The verifier does not trust the insert pass: it finds the kvpp ops by their overloads and the
registered attention/cache ops by name, with the configuration's `OpMatcher` (the insert pass's
precedence rule) but not the insert pass's stamps, and checks the graph as it stands. It takes an op's
layer from the compile's one reading (`GraphLayers`) only while the op still passes the layer argument
that reading saw; an op a pass added or changed is read again. `GraphFacts` reads the graph once; each check is a
small function over it, listed with
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
  `RoutesItself` (and left as it is) or is a `RoutedOp` of that layer whose rule is its spec's declaration
  (owner-local, or head-separable with the declared
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

from collections.abc import Callable, Iterable, Iterator

import torch.fx

from kvpp_fx.passes.layers import GraphLayers
from kvpp_fx.passes.pass_config import KVPPPassError, PassConfig
from kvpp_fx.passes.verify_bindings import (
    check_binding,
    check_components,
    check_originals,
    check_run_time_layer,
    check_tables,
)
from kvpp_fx.passes.verify_execution import check_pieces, check_routing
from kvpp_fx.passes.verify_facts import GraphFacts
from kvpp_fx.passes.verify_schedule import (
    check_counts,
    check_layers,
    check_order,
    check_outstanding,
    check_slot_reuse,
    check_slots,
)


class KVPPGraphVerificationError(KVPPPassError):
    """A rewritten graph breaks one of the KVPP invariants."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        self.checks = {check for check, _ in problems}
        super().__init__("KVPP graph verification failed:\n  - "
                         + "\n  - ".join(f"[{check}] {message}" for check, message in problems))


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


def verify_graph(gm: torch.fx.GraphModule, config: PassConfig, pieces: Iterable = (),
                 layers: GraphLayers | None = None) -> None:
    """Raise `KVPPGraphVerificationError` with every problem of `gm`'s graph (and of the compiled
    `pieces` of its split), each under the name of the check that found it. `layers`: the compile's
    reading of the registered ops (read here when not given)."""
    if layers is None:
        layers = GraphLayers.read(gm.graph, config.matcher, config.schedule.names)
    facts = GraphFacts.read(gm.graph, config, pieces, layers.for_config(config))
    problems = [(name, message) for name, check in CHECKS for message in check(facts)]
    if problems:
        raise KVPPGraphVerificationError(problems)
