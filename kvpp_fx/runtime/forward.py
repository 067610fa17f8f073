"""`Forward`: one model forward of a `KVPPRuntime`, its methods in the order the work happens.

    begin()                      choose the path (each request's rows, mode, history, packed blocks),
                                 prepare it, agree on it
    prefetch(first)              issue the first layer's broadcast, return at once
    per layer: wait(L)           complete L's broadcast into its view (the compute stream waits for it)
               prefetch(next)    issue the next layer's broadcast
               tables(L)         (packed slots) the block tables and slot mappings L reads, remapped
               owner_compute     (owner rows, in L's turn) L's routed ops run on L's owner
    end(error)                   complete what is in flight, then check what only the end can tell

A forward is in one of three modes: broadcast (every row reads blocks broadcast into the scratch slot),
owner (every row's attention runs on the layer's owner), or hybrid (``requests=``: some requests' rows
go to the owner, the others read the blocks broadcast for them only; `cost.choose_rows`).

A broadcast forward moves whole layers, or packs the blocks its rows touch into the front of each
scratch slot (`PackedBlocks`): always with compact slots, up to the crossover with whole-layer ones.

Invariants:
- Everything a forward moves, every rank agreed on in `begin`, before any byte moved; that includes
  which requests' rows go to the owner.
- A non-owner's attention reads a packed slot only through tables remapped for this forward's list
  (`tables`): an unlisted block is out of the slot's range (or, asked for kernels that read padding,
  position 0, which the caller checks).
- In a forward given ``requests=`` with owner rows, every target layer exchanged them before the next
  layer's wait (and the last before the forward ends): an op that skipped its exchange read a scratch
  slot that does not hold those rows' blocks (`OwnerRoutingError`).
- `prefetch`/`wait` follow `ProtocolState`: every rank raises the same named error at the same op.
- Nothing issued is cancelled. `end` completes an in-flight broadcast and the last exchange within the
  timeout. A failed or timed-out collective, or a forward that raised after issuing any, breaks the
  runtime (`Health`), since a peer may have paired what this rank issued with another collective.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvpp_fx.cache.cost import (
    BROADCAST,
    OWNER,
    BroadcastCost,
    RequestRows,
    RowChoice,
    StepLoad,
    choose_mode,
    choose_rows,
)
from kvpp_fx.runtime.active_blocks import PackedBlocks, Shape, block_ids
from kvpp_fx.runtime.agreement import AgreementKey, ForwardPath
from kvpp_fx.runtime.errors import (
    BlockSetMismatchError,
    InvalidBlocksError,
    OwnerModeUnsupportedError,
    OwnerRoutingError,
    SkippedLayerError,
    TransferFailedError,
)
from kvpp_fx.runtime.owner_exchange import HeadRule, OwnerExchange
from kvpp_fx.runtime.protocol import ProtocolState

if TYPE_CHECKING:
    from kvpp_fx.runtime.runtime import KVPPRuntime

AUTO = "auto"
HYBRID = "hybrid"


@dataclass(frozen=True)
class LayerRoute:
    """One target layer as the ops of every forward need it, computed once per runtime."""

    layer: int
    position: int  # in the plan's order
    slot: int
    owned: bool
    src: int  # the owner's global rank
    view: torch.Tensor  # this rank's bytes of the layer: persistent on the owner, its scratch slot elsewhere
    nbytes: int  # of a whole-layer broadcast
    block_views: tuple[torch.Tensor, ...]  # per component, [blocks, bytes per block], over `view`
    shape: Shape
    pack_views: tuple[torch.Tensor, ...] = ()  # the owner: per component, [S, bytes per block] of its own slot


class Forward:
    def __init__(self, runtime: KVPPRuntime, has_history: bool, blocks: Any, mode: str,
                 load: StepLoad | None, requests: tuple[RequestRows, ...] | None = None,
                 written: Any = None) -> None:
        self.runtime = runtime
        self.routes = runtime.routes
        self.transport = runtime.transport
        self.health = runtime.health
        self.stats = runtime.counters
        self.timeline = runtime.timeline
        self.overlap = runtime.overlap
        self.immediate_checks = runtime.api.immediate_checks
        self.protocol = ProtocolState(runtime.order)
        self.has_history = bool(has_history) and self.transport is not None
        self.blocks = blocks
        self.written = written
        self.mode = mode
        self.load = load
        self.requests = requests
        self.rows: RowChoice | None = None  # each request's path, when the forward names its requests
        self.choice: dict[str, Any] | None = None
        self.owner = False
        self.broadcasts = False  # whether each prefetch issues a broadcast
        self.active: PackedBlocks | None = None
        self.exchange: OwnerExchange | None = None
        self.issued = 0  # broadcasts started
        # the broadcast in flight (at most one): its layer, work handles, bytes, ids check, issue time
        self._route: LayerRoute | None = None
        self._work: Any = None
        self._nbytes = 0
        self._arrived: Callable[[], None] | None = None
        self._issued_ns = 0

    # --- begin: choose the path, prepare, agree ----------------------------------------------------

    def begin(self) -> None:
        """Everything this forward moves is decided, prepared and agreed on here, before any byte moves."""
        if self.requests is not None:
            self._choose_rows()
        self._choose_mode()
        self._prepare_packed()
        if self.runtime.agreement is not None:
            self.runtime.agreement.agree(self._agreement_key())
        rows = None
        if self.rows is not None:
            rows = {path: self.rows.rows(path, self.requests) for path in (BROADCAST, OWNER)}
        self.stats.begin_forward(self.has_history, self.mode, self.choice, rows)

    def _choose_rows(self) -> None:
        """``requests=``: each request's path by `choose_rows`; the broadcast moves only the broadcast
        requests' blocks, and the owner rows are the forward's load."""
        runtime, requests = self.runtime, self.requests
        mode = self.mode
        if self.transport is None:
            mode = BROADCAST  # a group of one: nothing moves in either mode
        elif mode != BROADCAST and runtime.attention is None:
            raise OwnerModeUnsupportedError(
                f'mode="{mode}" with requests= needs an attention shape (KVPPRuntime.create(attention=...)).')
        why = ""
        if mode == AUTO and runtime.layers_not_known_routed():
            mode, why = BROADCAST, f"layers {runtime.layers_not_known_routed()} are not known to be routed"
        attention = runtime.attention
        if attention is None or not self.routes:
            blocks = sorted({b for r in requests for b in r.blocks})
            self.rows = RowChoice((BROADCAST,) * len(requests), 0, 0, tuple(blocks), 0, 0,
                                  broadcast_written=tuple(sorted({b for r in requests for b in r.written}
                                                                 - set(blocks))))
        else:
            self.rows = choose_rows(attention, requests, mode, self._broadcast_cost(), runtime.plan.group_size,
                                    runtime.link)
        rows = self.rows
        self.choice = {"modes": list(rows.modes), "broadcast_bytes": rows.broadcast_bytes,
                       "owner_bytes": rows.owner_bytes, "why": rows.why or why}
        self.blocks = list(rows.broadcast_blocks)
        self.written = list(rows.broadcast_written)
        self.has_history = self.has_history and bool(rows.broadcast_blocks)
        if OWNER not in rows.modes:
            self.mode = BROADCAST
        else:
            self.load = StepLoad(rows.owner_tokens, rows.owner_pairs)
            self.mode = OWNER if BROADCAST not in rows.modes else HYBRID

    def _broadcast_cost(self) -> BroadcastCost:
        """What the first layer's broadcast of n blocks moves: the blocks, or the whole layer past the
        limit `_prepare_packed` applies (`KVPPPlan.uses_active_blocks`, monotone in n); with compact
        slots, the bound on the blocks the broadcast rows touch."""
        runtime, first = self.runtime, self.routes[0]
        plan, num_blocks = runtime.plan, runtime.storage.num_blocks
        limit = num_blocks if plan.compact else int(runtime.crossover * num_blocks)
        # Rows that do not fit go to their owners only where every layer is known to route them; elsewhere
        # the packed list refuses the step (ScratchOverflowError) before anything moves.
        routable = runtime.attention is not None and not runtime.layers_not_known_routed()
        return BroadcastCost(plan.active_broadcast_bytes(first.layer, 1), limit, first.nbytes,
                             runtime.storage.slot_blocks if plan.compact and routable else None)

    def _prepare_packed(self) -> None:
        """Packed blocks or whole layers; invalid ids, and a list wider than a compact slot, raise here,
        on every rank, before the agreement. Compact slots always pack (a whole layer does not fit),
        owner forwards never (nothing moves, no non-owner reads a slot)."""
        runtime = self.runtime
        plan = runtime.plan
        if self.transport is None or self.owner or not self.routes:
            return
        if plan.compact:
            if self.has_history and self.blocks is None:
                raise InvalidBlocksError(
                    "compact scratch slots hold only the blocks a step lists: a forward with history must "
                    "pass blocks= (and written=), or requests=.")
            self.active = PackedBlocks.prepare(self.blocks if self.has_history else (), self.written,
                                               runtime.storage, runtime.api)
        elif self.has_history and self.blocks is not None:
            count = len(block_ids(self.blocks, "blocks", runtime.storage.num_blocks))  # validated on every path
            if plan.uses_active_blocks(count, runtime.storage.num_blocks, runtime.crossover):
                self.active = PackedBlocks.prepare(self.blocks, self.written, runtime.storage, runtime.api)

    def _choose_mode(self) -> None:
        """Broadcast or owner mode (``"auto"``: the cost model's choice, which weighs the blocks' bytes)."""
        runtime = self.runtime
        if self.transport is None:
            self.mode = BROADCAST  # a group of one: every cache is local, nothing moves in either mode
        elif self.mode == AUTO and self.rows is None:
            self.choice = self._choose()
            self.mode = self.choice["mode"]
        self.owner = self.mode == OWNER
        if self.mode in (OWNER, HYBRID):
            self._check_owner_mode_can_run()
            local_heads = runtime.attention.split(runtime.plan.group_size) if runtime.attention is not None else None
            self.exchange = OwnerExchange(runtime.api, self.transport.collectives, runtime.group,
                                          runtime.plan.group_size, local_heads, self.load.query_tokens, self.stats,
                                          self.timeline)
        self.broadcasts = self.has_history and not self.owner

    def _choose(self) -> dict[str, Any]:
        """``mode="auto"``: the cost model's choice for this step, and both sides of the comparison."""
        runtime, load = self.runtime, self.load
        if runtime.attention is None or load is None:
            missing = "an attention shape (KVPPRuntime.create(attention=...))" if runtime.attention is None \
                else "the step's load (forward(..., load=StepLoad(...)))"
            raise OwnerModeUnsupportedError(f'mode="auto" needs {missing} to compare the two modes.')
        unknown = runtime.layers_not_known_routed()
        if unknown:
            return {"mode": BROADCAST, "why": f"layers {unknown} are not known to be routed for owner mode"}
        broadcast = 0
        if self.has_history:
            first, plan, num_blocks = self.routes[0], runtime.plan, runtime.storage.num_blocks
            count = (len(block_ids(self.blocks, "blocks", num_blocks)) if self.blocks is not None
                     else None)
            broadcast = (plan.active_broadcast_bytes(first.layer, count)
                         if count is not None and plan.uses_active_blocks(count, num_blocks, runtime.crossover)
                         else first.nbytes)
        return dataclasses.asdict(choose_mode(runtime.attention, load, broadcast, runtime.plan.group_size,
                                              runtime.link))

    def _check_owner_mode_can_run(self) -> None:
        unrouted = self.runtime.unrouted_layers()
        if unrouted:
            raise OwnerModeUnsupportedError(
                f"owner mode was asked, but the compiled graph of layers {unrouted} is not routed for it (one "
                "of its cache ops declares no owner rule in its AttentionOpSpec); nothing was moved. "
                'Use mode="broadcast" or "auto", or declare the ops and recompile.')
        if self.load is None:
            raise OwnerModeUnsupportedError(
                "owner mode needs the step's load (forward(..., load=StepLoad(query_tokens, attention_pairs))): "
                "every rank gathers that many query tokens, and the ranks agree on it first.")

    def _agreement_key(self) -> AgreementKey:
        query_tokens = self.load.query_tokens if self.load is not None else -1
        rows = _paths_digest(self.rows.modes) if self.rows is not None else 0
        if self.owner:
            return AgreementKey(ForwardPath.OWNER, query_tokens=query_tokens, row_paths=rows)
        if self.mode == HYBRID:
            active = self.active
            if not self.has_history or active is None:  # no block, or whole layers
                return AgreementKey(ForwardPath.HYBRID, -1 if self.has_history else 0, 0, query_tokens, rows)
            return AgreementKey(ForwardPath.HYBRID, active.count, active.digest, query_tokens, rows)
        if not self.has_history:
            return AgreementKey(ForwardPath.NO_HISTORY, query_tokens=query_tokens)
        active = self.active
        if active is None:
            return AgreementKey(ForwardPath.WHOLE_LAYERS, query_tokens=query_tokens, row_paths=rows)
        return AgreementKey(ForwardPath.ACTIVE_BLOCKS, active.count, active.digest, query_tokens, rows)

    # --- per layer: prefetch, wait ------------------------------------------------------------------

    def prefetch(self, layer: int, slot: int) -> None:
        timeline = self.timeline
        start = time.perf_counter_ns() if timeline is not None else 0
        position = self.protocol.prefetch(layer, slot)
        if self.broadcasts:
            self.issued += 1  # counted first: a failure while issuing may have left a peer's half pending
            self._issue(self.routes[position])
            if not self.overlap:
                self._complete()
        if timeline is not None:
            timeline.add(f"prefetch L{layer}", "prefetch", start, time.perf_counter_ns(), layer=layer, slot=slot,
                         communicate=self.has_history)

    def wait(self, layer: int, slot: int, routed: bool) -> torch.Tensor:
        timeline = self.timeline
        start = time.perf_counter_ns() if timeline is not None else 0
        if self.exchange is not None and not routed:
            self.runtime.order.locate(layer, slot)  # an unknown layer or a wrong slot is named first
            raise self._failed(OwnerModeUnsupportedError(
                f"a forward with owner rows reached layer {layer}, whose cache ops the graph does not route "
                "for owner mode (an op "
                "without an owner rule in its AttentionOpSpec, or a graph rewritten before owner mode); "
                "its attention would read a scratch slot that owner mode does not fill. Use "
                'mode="broadcast", or declare the ops (HeadSeparable / OwnerLocal) and recompile.'))
        position = self.protocol.wait(layer, slot)
        if self.rows is not None and self.exchange is not None and position > 0:
            self._check_exchanged(self.routes[position - 1].layer)
        self._complete()
        if timeline is not None:
            timeline.add(f"wait L{layer}", "wait", start, time.perf_counter_ns(), layer=layer)
        return self.routes[position].view

    def _issue(self, route: LayerRoute) -> None:
        active, transport = self.active, self.transport
        arrived = None
        if active is None:  # a whole layer: the owner's persistent bundle into the receivers' slot
            work = transport.issue(route.layer, route.slot, (route.view,), route.src)
            nbytes = route.nbytes
        elif active.count == 0:  # the step reads no block with history: nothing to move
            return
        else:
            ids, payload = active.payloads(self.runtime.storage, route.slot, route.layer)
            if route.owned:
                pack = functools.partial(active.pack, self.runtime.api, route.block_views, route.pack_views, ids)
                work = transport.issue(route.layer, route.slot, payload, route.src, pack)
            else:
                work = transport.issue(route.layer, route.slot, payload, route.src)
                arrived = functools.partial(active.check, ids)
            nbytes = sum(part.numel() for part in payload)
        self._route, self._work, self._nbytes, self._arrived = route, work, nbytes, arrived
        if self.timeline is not None:
            self._issued_ns = time.perf_counter_ns()

    def _complete(self) -> None:
        """The broadcast in flight, if any, completes into its view (the compute stream waits for it)."""
        work = self._work
        if work is None:
            return
        route, arrived = self._route, self._arrived
        self._work = None
        self.transport.complete(route.layer, route.slot, work, arrived)
        self.stats.record(route.position, self._nbytes)
        if arrived is not None and self.immediate_checks and not self.active.layer_arrived():
            raise self._mispaired(route.layer)
        if self.timeline is not None:
            self.timeline.add(f"broadcast L{route.layer}", "broadcast", self._issued_ns, time.perf_counter_ns(),
                              track="kvpp transfer stream", layer=route.layer, bytes=self._nbytes, src=route.src)

    # --- tables, inside a layer's turn -----------------------------------------------------------------

    def tables(self, layer: int, tables: list[torch.Tensor], kinds: list[str],
               request_rows: bool = True, unlisted_in_range: bool = False) -> list[torch.Tensor]:
        if len(tables) != len(kinds):
            raise ValueError(f"layer {layer}: {len(tables)} tables but {len(kinds)} table kinds.")
        position = self.runtime.order.positions.get(layer)
        if position is None:
            self.runtime.order.refuse(layer, -1)
        route = self.routes[position]
        active = self.active
        if active is None or route.owned:
            return tables
        api = self.runtime.api
        owner_rows = (tuple(k for k, mode in enumerate(self.rows.modes) if mode == OWNER)
                      if self.rows is not None and request_rows else ())
        return [active.remap(api, table, kind, owner_rows, unlisted_in_range) for table, kind in zip(tables, kinds)]

    # --- owner mode, inside a layer's turn --------------------------------------------------------

    def runs_owner_ops(self, layer: int) -> bool:
        return self._owner_turn(layer).owned

    def owner_compute(self, layer: int, rule: HeadRule, heads: Sequence[torch.Tensor],
                      compute: Callable[[list[torch.Tensor]], torch.Tensor],
                      output_like: torch.Tensor | None = None) -> torch.Tensor:
        route = self._owner_turn(layer)
        if self.exchange is None:
            raise OwnerRoutingError(f"a head-separable op of layer {layer} asked for owner mode's exchange in a "
                                    f"{self.mode}-mode forward.")
        return self.exchange.compute(layer, route.position, route.owned, route.src, rule, heads, compute,
                                     output_like)

    def _check_exchanged(self, layer: int) -> None:
        if layer not in self.exchange.exchanged:
            raise self._failed(OwnerRoutingError(
                f"layer {layer}'s attention ran in a forward with {self.load.query_tokens} owner rows without "
                "exchanging them: its op read a scratch slot that does not hold those rows' blocks. The op "
                "must send its owner rows through runtime.owner_compute (a RoutedOp, or an op declared "
                "RoutesItself whose implementation does)."))

    def _owner_turn(self, layer: int) -> LayerRoute:
        """The layer's route, checked to be in its turn (after its wait, before the next layer's)."""
        if not self.protocol.in_turn(layer):
            raise OwnerRoutingError(
                f"a routed cache op of layer {layer} ran outside its turn (the last awaited layer is "
                f"{self.protocol.last_awaited}); it must follow kvpp.wait of its own layer.")
        return self.routes[self.runtime.order.positions[layer]]

    # --- end --------------------------------------------------------------------------------------

    def end(self, error: BaseException | None) -> None:
        """Complete what is in flight, then check, in order, what only the end of the forward can tell.

        `error` is what the forward raised, if anything: it propagates unmasked, and breaks the runtime
        when this rank issued any collective before it."""
        try:
            self._settle(self._complete_on_host, propagate=error is None)
            if self.exchange is not None:
                self._settle(self.exchange.finish, propagate=error is None)
            if error is not None:
                if self.issued_any:
                    self.health.broken_by(error)
                return
            self.health.check()  # a failure inside this forward that the caller swallowed
            if self.exchange is not None and self.exchange.owners_failed():
                raise self.health.broken_by(OwnerRoutingError(
                    "an owner failed to compute a layer in this forward; this rank's outputs of that layer are "
                    "zeros."))
            if self.active is not None and self.issued and not self.immediate_checks \
                    and not self.active.all_arrived():
                raise self._mispaired(None)  # on a device the received ids are checked once, here
            unawaited = self.protocol.unawaited()
            if unawaited:
                raise self._failed(SkippedLayerError(
                    f"the forward ended without awaiting layers {unawaited}; every target layer must be "
                    "awaited once per forward."))
            if self.rows is not None and self.exchange is not None and self.routes:
                self._check_exchanged(self.routes[-1].layer)
        finally:
            self.stats.end_forward()

    def abandon(self) -> None:
        """The runtime closes inside this forward: its broadcast in flight gets at most the timeout (a
        failure breaks the runtime, which is closing anyway)."""
        work, self._work = self._work, None
        if work is not None:
            self._settle(lambda: self.transport.complete_on_host(self._route.layer, work), propagate=False)

    @property
    def issued_any(self) -> bool:
        return bool(self.issued or (self.exchange is not None and self.exchange.issued))

    def _complete_on_host(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            self.transport.complete_on_host(self._route.layer, work)
            self.stats.record(self._route.position, self._nbytes)

    @staticmethod
    def _settle(complete: Callable[[], None], propagate: bool) -> None:
        """Run one completion at the end; its failure (which broke the runtime) propagates unless the
        forward is already propagating an error of its own."""
        try:
            complete()
        except TransferFailedError:
            if propagate:
                raise

    def _failed(self, error: BaseException) -> BaseException:
        """A protocol error: it breaks the runtime when this rank already issued a collective."""
        return self.health.broken_by(error) if self.issued_any else error

    def _mispaired(self, layer: int | None) -> BaseException:
        where = f"with layer {layer}'s broadcast" if layer is not None else "in this forward"
        return self.health.broken_by(BlockSetMismatchError(
            f"the block ids received {where} are not this forward's set: the broadcast paired with another "
            "forward's or another rank's; this rank's view of the group can no longer be trusted."))


def _paths_digest(modes: tuple[str, ...]) -> int:
    """The requests' paths as one int64 for the agreement: which request went where, and how many."""
    return int.from_bytes(hashlib.blake2b(repr(modes).encode(), digest_size=8).digest(), "little") >> 2
