"""Which path a forward takes: a pure function of the step and of what the runtime knows.

`choose_path` decides, before anything moves and identically on every rank given the same step:
- with ``requests=``, each request's path (`cost.choose_rows`), hence the forward's mode: broadcast,
  owner, or hybrid (requests on both paths);
- otherwise the mode asked for, ``"auto"`` resolved by the cost model (`cost.choose_mode`);
- whether a broadcast forward packs the blocks its rows read (`pack`): always with compact slots,
  up to the crossover with whole-layer ones, never in an owner forward.

It raises the named errors of a step that cannot run (owner mode without a shape, a load, or routed
layers; a compact-slot forward with history but no blocks) before any byte moves. What the forward
then prepares (the packed lists, the exchange) and agrees on is `Forward.begin`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpp_fx.cache.block_ids import difference, union
from kvpp_fx.cache.cost import (
    AUTO,
    BROADCAST,
    HYBRID,
    OWNER,
    AttentionShape,
    BroadcastCost,
    LinkModel,
    Mode,
    RequestRows,
    RowChoice,
    StepLoad,
    choose_mode,
    choose_rows,
)
from kvpp_fx.runtime.active_blocks import block_ids
from kvpp_fx.runtime.errors import InvalidBlocksError, OwnerModeUnsupportedError


@dataclass(frozen=True)
class ForwardArguments:
    """What a caller of ``runtime.forward`` asked for: its arguments, checked."""

    has_history: bool
    blocks: Any = None
    written: Any = None
    mode: Mode = BROADCAST
    load: StepLoad | None = None
    requests: tuple[RequestRows, ...] | None = None
    history_ahead: bool = False  # a layer's first history chunk may stream before that layer's cache write


@dataclass(frozen=True)
class PathFacts:
    """What the runtime knows that the choice reads: the group, the layers' routing, the first layer's
    broadcast sizes (the cost model weighs one layer), and the slots."""

    alone: bool  # a group of one: every cache is local, nothing moves
    group_size: int
    attention: AttentionShape | None
    link: LinkModel
    has_layers: bool
    not_known_routed: tuple[int, ...]  # layers "auto" may not send to the owner
    unrouted: tuple[int, ...]  # layers whose graph is known not to be routed: owner mode refused
    compact: bool
    crossover: float
    num_blocks: int
    slot_blocks: int
    block_bytes: int  # one block of the first layer in a packed broadcast, its id included
    layer_bytes: int  # the first layer, whole

    @classmethod
    def of(cls, plan: Any, storage: Any, places: Sequence[Any], routing: Any, *, alone: bool,
           attention: AttentionShape | None, link: LinkModel, crossover: float) -> PathFacts:
        """A runtime's facts now (the routing changes as graphs compile)."""
        first = places[0] if places else None
        return cls(alone=alone, group_size=plan.group_size, attention=attention, link=link,
                   has_layers=first is not None, not_known_routed=routing.not_known_routed(),
                   unrouted=routing.unrouted(), compact=plan.compact, crossover=crossover,
                   num_blocks=storage.num_blocks, slot_blocks=storage.slot_blocks,
                   block_bytes=plan.active_broadcast_bytes(first.layer, 1) if first is not None else 0,
                   layer_bytes=first.nbytes if first is not None else 0)

    def packs(self, count: int) -> bool:
        """Whether a broadcast of `count` blocks sends them packed rather than whole layers
        (`KVPPPlan.uses_active_blocks`)."""
        return self.group_size > 1 and (self.compact or count <= self.crossover * self.num_blocks)


@dataclass(frozen=True)
class ChosenPath:
    mode: Mode  # BROADCAST, OWNER or HYBRID
    has_history: bool  # the forward broadcasts history (its broadcast requests read some)
    blocks: Any
    written: Any
    load: StepLoad | None
    rows: RowChoice | None  # each request's path, when the step named its requests
    choice: dict[str, Any] | None  # why: the cost comparison, when a choice was made
    pack: bool  # a broadcast forward packs its blocks into the slots

    @property
    def owner(self) -> bool:
        """Every row's attention runs on the owner."""
        return self.mode == OWNER

    @property
    def exchanges(self) -> bool:
        """Some rows go to their owners."""
        return self.mode in (OWNER, HYBRID)

    @property
    def broadcasts(self) -> bool:
        """Each prefetch issues a broadcast."""
        return self.has_history and not self.owner

    @property
    def hybrid(self) -> bool:
        """The requests take both paths."""
        return self.mode == HYBRID

    @property
    def owner_tokens(self) -> int:
        """The query tokens gathered to each layer's owner (0: none)."""
        return self.load.query_tokens if self.exchanges else 0

    @property
    def request_paths(self) -> tuple[str, ...] | None:
        """Each named request's path ("broadcast" or "owner"); None when the step named none."""
        return self.rows.modes if self.rows is not None else None


def choose_path(step: ForwardArguments, facts: PathFacts) -> ChosenPath:
    mode, has_history, blocks, written, load = step.mode, step.has_history and not facts.alone, step.blocks, \
        step.written, step.load
    rows = choice = None
    if step.requests is not None:
        rows, choice = _choose_rows(step, facts)
        blocks, written = rows.broadcast_blocks, rows.broadcast_written
        has_history = has_history and bool(rows.broadcast_blocks)
        if OWNER not in rows.modes:
            mode = BROADCAST
        else:
            load = StepLoad(rows.owner_tokens, rows.owner_pairs)
            mode = OWNER if BROADCAST not in rows.modes else HYBRID
    if facts.alone:
        mode = BROADCAST
    elif mode == AUTO and rows is None:
        choice = _choose_mode(facts, has_history, blocks, load)
        mode = Mode(choice["mode"])
    if mode in (OWNER, HYBRID):
        _check_owner_mode_can_run(facts, load)
    pack = mode != OWNER and _packs(facts, has_history, blocks)
    return ChosenPath(mode, has_history, blocks, written, load, rows, choice, pack)


def _choose_rows(step: ForwardArguments, facts: PathFacts) -> tuple[RowChoice, dict[str, Any]]:
    """``requests=``: each request's path by `choose_rows`; the broadcast moves only the broadcast
    requests' blocks, and the owner rows are the forward's load."""
    requests, mode = step.requests, step.mode
    if facts.alone:
        mode = BROADCAST  # a group of one: nothing moves in either mode
    elif mode != BROADCAST and facts.attention is None:
        raise OwnerModeUnsupportedError(
            f'mode="{mode}" with requests= needs an attention shape (KVPPRuntime.create(attention=...)).')
    why = ""
    if mode == AUTO and facts.not_known_routed:
        mode, why = BROADCAST, f"layers {list(facts.not_known_routed)} are not known to be routed"
    if facts.attention is None or not facts.has_layers:
        blocks = union(r.blocks for r in requests)
        rows = RowChoice((BROADCAST,) * len(requests), 0, 0, blocks, 0, 0,
                         broadcast_written=difference(union(r.written for r in requests), blocks))
    else:
        rows = choose_rows(facts.attention, requests, mode, _broadcast_cost(facts), facts.group_size, facts.link)
    return rows, {"modes": list(rows.modes), "broadcast_bytes": rows.broadcast_bytes,
                  "owner_bytes": rows.owner_bytes, "why": rows.why or why}


def _broadcast_cost(facts: PathFacts) -> BroadcastCost:
    """What the first layer's broadcast of n blocks moves: the blocks, or the whole layer past the
    crossover (monotone in n); with compact slots, the bound on the blocks the broadcast rows touch."""
    limit = facts.num_blocks if facts.compact else int(facts.crossover * facts.num_blocks)
    # Rows that do not fit go to their owners only where every layer is known to route them; elsewhere
    # the packed list refuses the step (ScratchOverflowError) before anything moves.
    routable = facts.attention is not None and not facts.not_known_routed
    return BroadcastCost(facts.block_bytes, limit, facts.layer_bytes,
                         facts.slot_blocks if facts.compact and routable else None)


def _choose_mode(facts: PathFacts, has_history: bool, blocks: Any, load: StepLoad | None) -> dict[str, Any]:
    """``mode="auto"``: the cost model's choice for this step, and both sides of the comparison."""
    if facts.attention is None or load is None:
        missing = "an attention shape (KVPPRuntime.create(attention=...))" if facts.attention is None \
            else "the step's load (forward(..., load=StepLoad(...)))"
        raise OwnerModeUnsupportedError(f'mode="auto" needs {missing} to compare the two modes.')
    if facts.not_known_routed:
        return {"mode": BROADCAST,
                "why": f"layers {list(facts.not_known_routed)} are not known to be routed for owner mode"}
    broadcast = 0
    if has_history:
        count = len(block_ids(blocks, "blocks", facts.num_blocks)) if blocks is not None else None
        broadcast = count * facts.block_bytes if count is not None and facts.packs(count) else facts.layer_bytes
    return dataclasses.asdict(choose_mode(facts.attention, load, broadcast, facts.group_size, facts.link))


def _check_owner_mode_can_run(facts: PathFacts, load: StepLoad | None) -> None:
    if facts.unrouted:
        raise OwnerModeUnsupportedError(
            f"owner mode was asked, but the compiled graph of layers {list(facts.unrouted)} is not routed for it "
            "(one of its cache ops declares no owner rule in its AttentionOpSpec); nothing was moved. "
            'Use mode="broadcast" or "auto", or declare the ops and recompile.')
    if load is None:
        raise OwnerModeUnsupportedError(
            "owner mode needs the step's load (forward(..., load=StepLoad(query_tokens, attention_pairs))): "
            "every rank gathers that many query tokens, and the ranks agree on it first.")


def _packs(facts: PathFacts, has_history: bool, blocks: Any) -> bool:
    """Packed blocks or whole layers. Compact slots always pack (a whole layer does not fit); invalid
    ids raise here, on every rank, before the agreement."""
    if facts.alone or not facts.has_layers:
        return False
    if facts.compact:
        if has_history and blocks is None:
            raise InvalidBlocksError(
                "compact scratch slots hold only the blocks a step lists: a forward with history must "
                "pass blocks= (and written=), or requests=.")
        return True
    if has_history and blocks is not None:
        return facts.packs(len(block_ids(blocks, "blocks", facts.num_blocks)))  # validated on every path
    return False


def forward_arguments(has_history: bool, blocks: Any, written: Any, mode: str, load: StepLoad | None,
            requests: Sequence[RequestRows] | None, history_ahead: bool = False) -> ForwardArguments:
    """``runtime.forward``'s arguments, checked."""
    if mode not in (BROADCAST, OWNER, AUTO):
        raise ValueError(f"mode must be one of {[m.value for m in (BROADCAST, OWNER, AUTO)]}, got {mode!r}.")
    if requests is not None:
        if blocks is not None or load is not None or written is not None:
            raise ValueError("runtime.forward(requests=...) derives the blocks and the load from the "
                             "requests; pass none of blocks, written and load.")
        requests = tuple(requests)
        if not all(isinstance(r, RequestRows) for r in requests):
            raise ValueError("requests must be RequestRows.")
    return ForwardArguments(bool(has_history), blocks, written, Mode(mode), load, requests, bool(history_ahead))
