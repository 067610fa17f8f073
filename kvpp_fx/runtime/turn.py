"""`LayerTurn`: one target layer's turn in a forward, from its wait until the next layer's wait.

`Forward.wait` opens the turn, which `Forward.turn` hands out (built when first asked for); what runs
inside the turn acts on it, never on the forward: a routed op (`RoutedOp`) or a vLLM attention hook
asks the turn whether this rank runs the layer's owner-local ops (`owned`), which path the forward's
requests take (`path`), sends a head-separable op's rows to the layer's owner (`owner_compute`), and
streams a chunk of prefill history from the owner (`stream_history`).
The facade hands the open turn to whoever asks for it by layer (`KVPPRuntime.turn`).

Invariant: a turn acts only while it is open. `Forward.turn` refuses a layer whose turn is not the open
one, and a turn kept past the next layer's wait refuses to exchange (`OwnerRoutingError`), so an op that
runs before its layer's wait or after the next layer's cannot reach another layer's owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvpp_fx.runtime.errors import OwnerRoutingError

if TYPE_CHECKING:
    from kvpp_fx.runtime.context_rows import ChunkPlan, ContextRows
    from kvpp_fx.runtime.owner_exchange import HeadRule, OwnerExchange
    from kvpp_fx.runtime.layer_route import LayerRoute
    from kvpp_fx.runtime.path import ChosenPath


class LayerTurn:
    """A target layer's turn: its route (slot, view, owner), the forward's path, and owner mode's exchange.

    A plain class with slots: a forward opens one per target layer, on the host's path of every step."""

    __slots__ = ("route", "path", "exchange", "context_rows", "before_exchange", "history_next")

    def __init__(self, route: LayerRoute, path: ChosenPath, exchange: OwnerExchange | None,
                 context_rows: ContextRows, before_exchange: Callable[[LayerTurn], None],
                 history_next: LayerRoute | None = None) -> None:
        self.route = route
        self.path = path
        self.exchange = exchange  # None when no row of the forward goes to an owner
        self.context_rows = context_rows
        self.before_exchange = before_exchange  # the forward's checks before an exchange: still open, agreed
        # the next target layer, whose first history chunk may be issued in this turn (``history_ahead``)
        self.history_next = history_next

    @property
    def layer(self) -> int:
        return self.route.layer

    @property
    def view(self) -> torch.Tensor:
        """The bytes attention reads: the persistent cache on the owner, the layer's scratch slot elsewhere."""
        return self.route.view

    @property
    def owned(self) -> bool:
        """Whether this rank owns the layer: in owner mode, it runs the layer's owner-local ops (the writes)."""
        return self.route.owned

    def owner_compute(self, rule: HeadRule, heads: Sequence[torch.Tensor],
                      compute: Callable[[list[torch.Tensor]], torch.Tensor],
                      output_like: torch.Tensor | None = None) -> torch.Tensor:
        """Run a head-separable op of the layer on its owner over every rank's heads; return this rank's
        part (`OwnerExchange.compute`). ``rule`` is the op's declaration (its head operands' dimensions,
        token dimensions, output dimension and output-like operand); ``heads`` are this rank's head
        operands; ``output_like`` a tensor shaped as this rank's part of the output, when no head operand is."""
        self.before_exchange(self)
        route = self.route
        if self.exchange is None:
            raise OwnerRoutingError(f"a head-separable op of layer {route.layer} asked for owner mode's exchange in "
                                    f"a {self.path.mode}-mode forward.")
        return self.exchange.compute(route.layer, route.position, route.owned, route.src, rule, heads, compute,
                                     output_like)

    def stream_history(self, rows: torch.Tensor, gather: Callable[[], object], plan: ChunkPlan | None = None) -> None:
        """Fill ``rows`` with one chunk of a prefill row's history from the layer's owner: ``gather()``
        writes it there on the owner, one broadcast brings it to every rank (`ContextRows.stream`). With
        ``plan``, the next chunk (this layer's, or the next layer's first) is issued before this returns,
        and its own call finds it in flight."""
        self.before_exchange(self)
        self.context_rows.stream(self.route, rows, gather, plan, self.history_next)
