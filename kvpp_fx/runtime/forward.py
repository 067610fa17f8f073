"""`Forward`: one model forward of a `KVPPRuntime`, its methods in the order the work happens.

    begin()                      choose the path (requests' rows, mode, history, packed blocks), prepare, agree
    prefetch(first)              issue the first layer's broadcast, return at once
    per layer: wait(L)           complete L's broadcast into its view (the compute stream waits for it),
                                 open L's turn (`LayerTurn`) and return it; the next wait closes it.
                                 L's ops act on the turn: its views, its tables (packed slots: remapped,
                                 `PackedTables`), its owner rows' exchange, its streamed history
               prefetch(next)    issue the next layer's broadcast
    end(error)                   complete what is in flight, then check what only the end can tell

A forward is in one of three modes: broadcast (every row reads blocks broadcast into the scratch slot), owner
(every row's attention runs on the layer's owner), or hybrid (``requests=``: some requests' rows go to the
owner, the others read the blocks broadcast for them only; `cost.choose_rows`).

A broadcast forward moves whole layers, or packs the blocks its rows touch into the front of each scratch
slot (`PackedBlocks`): always with compact slots, up to the crossover with whole-layer ones.

Invariants:
- Everything a forward moves, every rank agreed on in `begin`, before any byte moved; that includes
  which requests' rows go to the owner.
- A non-owner's attention reads a packed slot only through tables remapped for this forward's list
  (`PackedTables`, one per forward): an unlisted block is out of the slot's range (or, asked for kernels
  that read padding, position 0, which the caller checks).
- In a forward given ``requests=`` with owner rows, every target layer exchanged them before the next
  layer's wait (and the last before the forward ends): an op that skipped its exchange read a scratch
  slot that does not hold those rows' blocks (`OwnerRoutingError`).
- `prefetch`/`wait` follow `ProtocolState`: every rank raises the same named error at the same op.
- Nothing issued is cancelled. `end` completes an in-flight broadcast and the last exchange within the
  timeout. A failed or timed-out collective, or a forward that raised after issuing any, breaks the
  runtime (`Health`), since a peer may have paired what this rank issued with another collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpp_fx.cache.cost import BROADCAST, OWNER
from kvpp_fx.runtime.active_blocks import PackedBlocks
from kvpp_fx.runtime.agreement import AgreementKey, PendingAgreement
from kvpp_fx.runtime.errors import (
    BlockSetMismatchError,
    OwnerModeUnsupportedError,
    OwnerRoutingError,
    SkippedLayerError,
    TransferFailedError,
)
from kvpp_fx.runtime.owner_exchange import OwnerExchange
from kvpp_fx.runtime.packed_tables import PackedTables
from kvpp_fx.runtime.parts import ForwardParts
from kvpp_fx.runtime.path import ChosenPath, PathFacts, ForwardArguments, choose_path
from kvpp_fx.runtime.pending import check_flag, folded
from kvpp_fx.runtime.protocol import ProtocolState, locate, refuse
from kvpp_fx.runtime.transport import BroadcastInFlight
from kvpp_fx.runtime.turn import LayerTurn
from kvpp_fx.schedule import WAIT


class Forward:
    def __init__(self, parts: ForwardParts, arguments: ForwardArguments, facts: PathFacts, number: int = 0,
                 on_turn: Callable[[LayerTurn], None] | None = None) -> None:
        self.parts = parts  # everything else of the runtime a forward reads
        self.number = number  # the runtime's count of forwards, this one included
        self.on_turn = on_turn  # handed each turn as its wait opens it
        self.immediate_checks = parts.api.immediate_checks
        self.protocol = ProtocolState(parts.schedule)
        self.arguments = arguments  # what the caller of ``runtime.forward`` asked for
        self.facts = facts
        self.path: ChosenPath | None = None
        self.active: PackedBlocks | None = None
        self._tables: PackedTables | None = None  # a packing forward's remap, for non-owned layers
        self.exchange: OwnerExchange | None = None
        self._turn: LayerTurn | None = None  # the last awaited layer's, open until the next wait
        # issued in begin; checked before the first collective on gloo, at the end on a device (no host wait)
        self._agreement: PendingAgreement | None = None
        self._broadcasts = False  # each prefetch issues a broadcast (`begin`)
        self._checks_exchanges = False  # each layer's owner rows must have been exchanged (`begin`)
        self.issued, self._chunks_before = 0, parts.context_rows.issued  # broadcasts; history chunks before it
        self._agreement_issued = False
        self._flight: BroadcastInFlight | None = None  # the broadcast in flight (at most one)

    # --- begin: choose the path, prepare, agree ----------------------------------------------------

    def begin(self) -> ChosenPath:
        """Everything this forward moves is decided, prepared and agreed on here, before any byte moves;
        returns the path, which the forward keeps to the end."""
        path = self.path = choose_path(self.arguments, self.facts)
        parts = self.parts
        if path.exchanges:
            local_heads = parts.attention.split(parts.group_size) if parts.attention is not None else None
            self.exchange = OwnerExchange(parts.api, parts.transport.collectives, parts.exchange_group,
                                          parts.group_size, local_heads, path.load.query_tokens, parts.stats,
                                          parts.timeline)
        if path.pack:
            self.active = PackedBlocks.prepare(path.blocks if path.has_history else (), path.written, parts.storage,
                                               parts.api)
            self._tables = PackedTables(self.active, parts.api, path.request_paths)
        if parts.agreement is not None:
            self._agreement = parts.agreement.issue(AgreementKey.of(path, self.active, self.arguments.history_ahead))
            self._agreement_issued = True
        rows = None
        if path.rows is not None:
            rows = {mode: path.rows.rows(mode, self.arguments.requests) for mode in (BROADCAST, OWNER)}
        parts.stats.begin_forward(path.has_history, path.mode, path.choice, rows)
        self._broadcasts = path.broadcasts
        self._checks_exchanges = path.rows is not None and self.exchange is not None
        return path

    # --- per layer: prefetch, wait ------------------------------------------------------------------

    def prefetch(self, layer: int, slot: int) -> None:
        parts = self.parts
        timeline = parts.timeline
        start = time.perf_counter_ns() if timeline is not None else 0
        if self._agreement is not None and self.immediate_checks:
            self._agreed()
        position = self.protocol.prefetch(layer, slot)
        if self._broadcasts:
            self.issued += 1  # counted first: a failure while issuing may have left a peer's half pending
            self._flight = parts.transport.issue_layer(parts.places[position], self.active, parts.storage,
                                                       timeline is not None)
            if not parts.overlap:
                self._complete()
        if timeline is not None:
            timeline.add(f"prefetch L{layer}", "prefetch", start, time.perf_counter_ns(), layer=layer, slot=slot,
                         communicate=self.path.has_history)

    def wait(self, layer: int, slot: int, routed: bool) -> LayerTurn:
        """Complete `layer`'s broadcast and open its turn (which the next wait closes); returns the turn."""
        parts, timeline = self.parts, self.parts.timeline
        start = time.perf_counter_ns() if timeline is not None else 0
        if self.exchange is not None and not routed:
            locate(parts.schedule, layer, slot)  # an unknown layer or a wrong slot is named first
            raise self._failed(OwnerModeUnsupportedError.unrouted(layer))
        position = self.protocol.wait(layer, slot)
        if self._checks_exchanges and position > 0:
            self._check_exchanged(parts.places[position - 1].layer)
        if self._flight is not None:
            self._complete()
        if timeline is not None:
            timeline.add(f"wait L{layer}", "wait", start, time.perf_counter_ns(), layer=layer)
        turn = self._turn = parts.turns[position].open(self)
        if self.on_turn is not None:
            self.on_turn(turn)
        return turn

    def enter_layer(self, layer: int, routed: bool) -> LayerTurn | None:
        """The schedule's entry for `layer` (`LayerSchedule.entry`), whose first prefetch follows what this
        forward issued; returns the layer's turn, None for a local draft layer (nothing to wait for)."""
        schedule, protocol = self.parts.schedule, self.protocol
        if schedule.position_or_none(layer) is None:
            if layer in schedule.draft_layers:
                return None
            refuse(schedule, layer, -1)
        for step in schedule.entry(layer, first_issued=protocol.next_position > 0 or protocol.in_flight is not None):
            if step.kind == WAIT:
                self.wait(step.layer, step.slot, routed)
            else:
                self.prefetch(step.layer, step.slot)
        return self._turn

    def packed_tables(self) -> PackedTables | None:
        """The forward's remap to packed slots (None where it packs nothing): one object per forward."""
        return self._tables

    def open_turn(self) -> LayerTurn | None:
        """The turn the last wait opened (None before the first): what a hook below the graph acts on."""
        return self._turn

    def _complete(self) -> None:
        """The broadcast in flight, if any, completes into its view (the compute stream waits for it)."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        place, parts = flight.place, self.parts
        parts.transport.complete(place.layer, place.slot, flight.work, flight.arrived)
        parts.stats.record(place.position, flight.nbytes)
        if flight.arrived is not None and self.immediate_checks and not self.active.layer_arrived():
            raise self._mispaired(place.layer)
        if parts.timeline is not None:
            parts.timeline.add(f"broadcast L{place.layer}", "broadcast", flight.issued_ns, time.perf_counter_ns(),
                              track="kvpp transfer stream", layer=place.layer, bytes=flight.nbytes, src=place.src)

    def _agreed(self) -> None:
        """The agreement issued in `begin` completed and every rank's key is this rank's."""
        pending, self._agreement = self._agreement, None
        pending.check(late=not self.immediate_checks)

    # --- inside a layer's turn ---------------------------------------------------------------------

    def before_exchange(self, turn: LayerTurn) -> None:
        """Before a turn's exchange: the runtime is not broken, the turn is the open one, the ranks agreed."""
        if self.parts.health.cause is not None:  # a failure a hook swallowed: its named cause, not a timeout
            self.parts.health.check()
        if turn is not self._turn:  # kept past the next layer's wait, or the forward's end
            raise OwnerRoutingError.outside_turn(turn.layer, self._turn.layer if self._turn is not None else None)
        if self._agreement is not None and self.immediate_checks:  # gloo aborts on a collective of another size
            self._agreed()

    def _check_exchanged(self, layer: int) -> None:
        if layer not in self.exchange.exchanged:
            raise self._failed(OwnerRoutingError.not_exchanged(layer, self.path.owner_tokens))

    # --- end --------------------------------------------------------------------------------------

    def end(self, error: BaseException | None) -> None:
        """Complete what is in flight, then check, in order, what only the end of the forward can tell.

        `error` is what the forward raised, if anything: it propagates unmasked, and breaks the runtime
        when this rank issued any collective before it (on a device, its agreement: `issued_any`). On a
        device, what the device computed (the ids that arrived, the owners' status) is left to be read
        later, without the host waiting (`PendingChecks`)."""
        try:
            if self._agreement is not None:
                late = not self.immediate_checks
                try:  # before anything else: a forward whose ranks disagreed says so, whatever followed
                    self._agreed()
                except (BlockSetMismatchError, TransferFailedError) as exc:
                    # Checked late (a device), the ranks may have issued collectives that do not pair, some
                    # ranks none: every rank breaks. The disagreement is the cause of whatever else failed.
                    if late:
                        self.parts.health.broken_by(exc)
                    if error is None:
                        raise self._failed(exc) from None
                    if error.__cause__ is None:
                        error.__cause__ = exc
            self._settle(self._complete_on_host, propagate=error is None)
            self._settle(self.parts.context_rows.finish, propagate=error is None)
            if error is not None:
                if self.issued_any:
                    self.parts.health.broken_by(error)
                if self.exchange is not None and self.exchange.failed_here and not self.immediate_checks:
                    # The other ranks learnt this owner's failure from its status and finish the forward,
                    # whose end issues the checks' all-reduce: this rank issues its half too.
                    self._settle(self._leave_device_checks, propagate=False)
                return
            self.parts.health.check()  # a failure inside this forward that the caller swallowed
            if not self.immediate_checks:
                self._leave_device_checks()
            unawaited = self.protocol.unawaited()
            if unawaited:
                raise self._failed(SkippedLayerError(
                    f"the forward ended without awaiting layers {unawaited}; every target layer must be "
                    "awaited once per forward."))
            if self._checks_exchanges and self.parts.places:
                self._check_exchanged(self.parts.places[-1].layer)
        finally:
            self._settle(self.parts.context_rows.finish, propagate=False)  # a chunk left in flight by a raise
            self._turn = None  # no turn of this forward is open: a kept one refuses to exchange
            self.parts.stats.end_forward()

    def _leave_device_checks(self) -> None:
        """What the device checked in this forward, each check's maximum over the group folded into one flag,
        read later (`PendingChecks`). Every rank issues the all-reduce in every forward."""
        parts, exchange = self.parts, self.exchange
        active = self.active
        flag = check_flag(parts.storage.device,
                          active.arrived.logical_not() if active is not None and self.issued else None,
                          exchange.failed if exchange is not None else None,
                          exchange is not None and exchange.failed_here,
                          active.unlisted_reads if active is not None else None)
        if parts.transport is not None:
            parts.transport.collectives.run(lambda: parts.api.all_reduce_max(flag, parts.group), "the forward's checks")
        parts.checks.leave(self.number, parts.api.read_later(folded(flag)))

    def abandon(self) -> None:
        """The runtime closes inside this forward: its broadcast in flight gets at most the timeout (a
        failure breaks the runtime, which is closing anyway)."""
        flight, self._flight = self._flight, None
        if flight is not None:
            self._settle(lambda: self.parts.transport.complete_on_host(flight.place.layer, flight.work),
                         propagate=False)
        self._settle(self.parts.context_rows.finish, propagate=False)

    @property
    def issued_any(self) -> bool:
        """Whether a peer's collectives may now pair with other ones of this rank: this forward issued one, or,
        checked late (a device), it issued its agreement, past which the peers issue the forward's collectives
        without the host waiting for this rank's; its next forward's would pair with them."""
        return bool(self.issued or (self.exchange is not None and self.exchange.issued)
                    or self.parts.context_rows.issued != self._chunks_before
                    or (self._agreement_issued and not self.immediate_checks))

    def _complete_on_host(self) -> None:
        flight, self._flight = self._flight, None
        if flight is not None:
            self.parts.transport.complete_on_host(flight.place.layer, flight.work)
            self.parts.stats.record(flight.place.position, flight.nbytes)

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
        return self.parts.health.broken_by(error) if self.issued_any else error

    def _mispaired(self, layer: int) -> BaseException:
        return self.parts.health.broken_by(BlockSetMismatchError.mispaired(layer))
