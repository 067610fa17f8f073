"""`LayerTurn`: one target layer's turn in a forward, from its wait until the next layer's wait.

`Forward.wait` opens the turn and returns it, through the facade's ``wait`` and ``enter_layer``, to the
op that waited; a hook below the graph that runs inside the same turn reads it as the forward's open turn
(`KVPPRuntime.open_turn`). Whatever runs inside the turn acts on it, never on the forward or on the
runtime: the views of the layer's caches (`views`), its tables remapped to a packed slot (`tables`,
`packed`), whether this rank owns the layer (`owned`), the forward's path (`path`), whether some of its
rows go to the owner (`rows_to_owner`) and whether this rank skips the layer's cache write
(`skips_cache_write`); it sends a head-separable op's rows to the owner (`owner_compute`) and streams a
chunk of prefill history from the owner (`stream_history`).

Invariant: a turn acts only while it is open. A turn kept past the next layer's wait (or its forward's end)
refuses to exchange (`OwnerRoutingError`), so an op that runs after the next layer's wait cannot reach
another layer's owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvpp_fx.runtime.errors import OwnerRoutingError

if TYPE_CHECKING:
    from kvpp_fx.runtime.context_rows import ChunkPlan, ContextRows
    from kvpp_fx.runtime.layer_route import LayerRoute
    from kvpp_fx.runtime.owner_exchange import HeadRule, OwnerExchange
    from kvpp_fx.runtime.packed_tables import PackedTables
    from kvpp_fx.runtime.path import ChosenPath


class LayerTurn:
    """A target layer's turn: its route (slot, view, owner), the forward's path, its packed tables, and owner
    mode's exchange.

    A plain class with slots: a forward opens one per target layer, on the host's path of every step."""

    __slots__ = ("route", "path", "packed", "exchange", "context_rows", "before_exchange", "history_next")

    def __init__(self, route: LayerRoute, path: ChosenPath, packed: PackedTables | None,
                 exchange: OwnerExchange | None, context_rows: ContextRows,
                 before_exchange: Callable[[LayerTurn], None], history_next: LayerRoute | None = None) -> None:
        self.route = route
        self.path = path
        # the forward's remap to packed slots where this rank reads the layer from one; None for an owned
        # layer, or a forward that packs nothing
        self.packed = packed
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

    @property
    def rows_to_owner(self) -> bool:
        """Some rows of the forward (all in owner mode, the owner requests' in a hybrid one) run the layer's
        attention on its owner."""
        return self.path.owner_tokens > 0

    @property
    def skips_cache_write(self) -> bool:
        """Every row of the forward goes to the owner and this rank does not own the layer: its writes would
        land in a scratch slot nothing reads."""
        return self.path.owner and not self.route.owned

    def views(self, caches: Sequence[torch.Tensor], components: Sequence[str], op: str) -> list[torch.Tensor]:
        """This rank's views of the layer for a graph's cache operands (by component), checked against them."""
        views = self.route.typed_views
        out = []
        for cache, name in zip(caches, components):
            if name not in views:
                raise KeyError(f"{op}: layer {self.layer} has no cache component {name!r}; it has {sorted(views)}.")
            view = views[name]
            if view.shape != cache.shape or view.dtype != cache.dtype:
                raise ValueError(
                    f"{op} for layer {self.layer}: the graph's {name!r} cache is {tuple(cache.shape)} "
                    f"{cache.dtype}, the runtime's view is {tuple(view.shape)} {view.dtype}.")
            out.append(view)
        return out

    def tables(self, tables: Sequence[torch.Tensor], kinds: Sequence[str]) -> list[torch.Tensor]:
        """The block tables and slot mappings the layer's attention reads (rows: the forward's requests in
        order): remapped where this rank reads the layer from its packed slot (`PackedTables.remap`), as
        given elsewhere (an owned layer, a whole-layer broadcast, owner mode)."""
        if self.packed is None:
            if len(tables) != len(kinds):
                raise ValueError(f"layer {self.layer}: {len(tables)} tables but {len(kinds)} table kinds.")
            return list(tables)
        return self.packed.remap(tables, kinds)

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
