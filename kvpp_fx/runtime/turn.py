"""`LayerTurn`: one target layer's turn in a forward, from its wait until the next layer's wait.

`Forward.wait` opens the turn and returns it, through the facade's ``wait`` and ``enter_layer``, to the
op that waited, and hands it to the forward's listener (``runtime.forward(on_turn=)``), through which code
below the graph gets it (vLLM's hooks: `integrations.vllm.engine.state.open_turn`); a routed op, a graph
target nothing can hand it to, reads the forward's open turn (`KVPPRuntime.open_turn`) and checks its layer.
Whatever runs inside the turn acts on it, never on the forward or on the runtime: the views of the layer's
caches (`views`), its tables remapped to a packed slot (`tables`, `packed`), whether this rank owns the
layer (`owned`), the forward's path (`path`), whether some of its rows go to the owner (`rows_to_owner`)
and whether this rank skips the layer's cache write (`skips_cache_write`); it sends a head-separable op's
rows to the owner (`owner_compute`) and streams a chunk of prefill history from the owner
(`stream_history`).

Invariant: a turn exchanges only while it is open. A turn kept past the next layer's wait (or its forward's
end) refuses to exchange (`OwnerRoutingError`), so an op that runs after the next layer's wait cannot reach
another layer's owner; the layer's wait in a later forward re-opens the same object for that forward. Its
other accessors answer for the forward that opened it last: take a turn from its wait or the listener, for
the layer's turn only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kvpp_fx.runtime.errors import OwnerRoutingError

if TYPE_CHECKING:
    from kvpp_fx.runtime.context_rows import ChunkPlan, ContextRows
    from kvpp_fx.runtime.layer_place import LayerPlace
    from kvpp_fx.runtime.owner_exchange import HeadRule, OwnerExchange
    from kvpp_fx.runtime.packed_tables import PackedTables
    from kvpp_fx.runtime.path import ChosenPath, ForwardArguments


class TurnSource(Protocol):
    """What a turn reads of the forward that opened it (`Forward`)."""

    arguments: ForwardArguments
    path: ChosenPath
    exchange: OwnerExchange | None  # None when no row of the forward goes to an owner

    def packed_tables(self) -> PackedTables | None: ...

    def before_exchange(self, turn: LayerTurn) -> None:
        """The forward's checks before a turn exchanges: the turn is still the open one, the ranks agreed."""


class LayerTurn:
    """A target layer's turn: its place (slot, view, owner) and the forward that opened it last, whose path,
    packed tables and owner exchange the turn's ops act on.

    One per target layer for the runtime's life (FSDP2 keeps its per-group state the same way), built with
    the layer's place; each forward's wait of the layer re-opens it (`open`), on the host's path of every
    step. A turn acts only while it is its forward's open turn (`TurnSource.before_exchange`)."""

    __slots__ = ("place", "next_place", "context_rows", "forward")

    def __init__(self, place: LayerPlace, next_place: LayerPlace | None, context_rows: ContextRows) -> None:
        self.place = place
        self.next_place = next_place  # the next target layer's, None for the last
        self.context_rows = context_rows  # the runtime's history stream
        self.forward: TurnSource | None = None

    def open(self, forward: TurnSource) -> LayerTurn:
        self.forward = forward
        return self

    @property
    def history_next(self) -> LayerPlace | None:
        """The next target layer, whose first history chunk may be issued in this turn, where the forward
        allows it (``history_ahead``)."""
        return self.next_place if self.forward.arguments.history_ahead else None

    @property
    def path(self) -> ChosenPath:
        """The forward's path: its mode, each request's path, whether it packs."""
        return self.forward.path

    @property
    def packed(self) -> PackedTables | None:
        """The forward's remap to packed slots where this rank reads the layer from one; None for an owned
        layer, or a forward that packs nothing."""
        return None if self.place.owned else self.forward.packed_tables()

    @property
    def layer(self) -> int:
        return self.place.layer

    @property
    def view(self) -> torch.Tensor:
        """The bytes attention reads: the persistent cache on the owner, the layer's scratch slot elsewhere."""
        return self.place.view

    @property
    def owned(self) -> bool:
        """Whether this rank owns the layer: in owner mode, it runs the layer's owner-local ops (the writes)."""
        return self.place.owned

    @property
    def rows_to_owner(self) -> bool:
        """Some rows of the forward (all in owner mode, the owner requests' in a hybrid one) run the layer's
        attention on its owner."""
        return self.forward.path.owner_tokens > 0

    @property
    def skips_cache_write(self) -> bool:
        """Every row of the forward goes to the owner and this rank does not own the layer: its writes would
        land in a scratch slot nothing reads."""
        return self.forward.path.owner and not self.place.owned

    def views(self, caches: Sequence[torch.Tensor], components: Sequence[str], op: str) -> list[torch.Tensor]:
        """This rank's views of the layer for a graph's cache operands (by component), checked against them."""
        views = self.place.typed_views
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
        if len(tables) != len(kinds):
            raise ValueError(f"layer {self.layer}: {len(tables)} tables but {len(kinds)} table kinds.")
        packed = self.packed
        return list(tables) if packed is None else packed.remap(tables, kinds)

    def owner_compute(self, rule: HeadRule, heads: Sequence[torch.Tensor],
                      compute: Callable[[list[torch.Tensor]], torch.Tensor],
                      output_like: torch.Tensor | None = None) -> torch.Tensor:
        """Run a head-separable op of the layer on its owner over every rank's heads; return this rank's
        part (`OwnerExchange.compute`). ``rule`` is the op's declaration (its head operands' dimensions,
        token dimensions, output dimension and output-like operand); ``heads`` are this rank's head
        operands; ``output_like`` a tensor shaped as this rank's part of the output, when no head operand is."""
        forward, place = self.forward, self.place
        forward.before_exchange(self)
        if forward.exchange is None:
            raise OwnerRoutingError(f"a head-separable op of layer {place.layer} asked for owner mode's exchange in "
                                    f"a {forward.path.mode}-mode forward.")
        return forward.exchange.compute(place.layer, place.position, place.owned, place.src, rule, heads, compute,
                                     output_like)

    def stream_history(self, rows: torch.Tensor, gather: Callable[[], object], plan: ChunkPlan | None = None) -> None:
        """Fill ``rows`` with one chunk of a prefill row's history from the layer's owner: ``gather()``
        writes it there on the owner, one broadcast brings it to every rank (`ContextRows.stream`). With
        ``plan``, the next chunk (this layer's, or the next layer's first) is issued before this returns,
        and its own call finds it in flight."""
        self.forward.before_exchange(self)
        self.context_rows.stream(self.place, rows, gather, plan, self.history_next)
