"""`KVPPRuntime`: the object users hold. It owns every cache byte of its rank and serves the ops.

Per forward (``with runtime.forward(has_history): ...``) the graph calls the plan's `LayerSchedule`:
``prefetch(first)``, then ``wait(L)`` and ``prefetch(next)`` per target layer. ``prefetch`` issues the
layer's broadcast on the calling thread and returns at once; ``wait`` makes the compute stream wait for
it and returns the layer's turn (`LayerTurn`), whose views attention must read: persistent on the
owner, the layer's scratch slot elsewhere. A broadcast-mode forward without history moves no bytes. Owner mode
(``mode="owner"``):
routed head-separable ops run on each layer's owner over every rank's heads (its turn's `owner_compute`), the
owner-local ops (the writes) on the owner only. ``mode="auto"`` picks per forward with the cost model,
and owner mode only for layers known to be routed (`note_routing`); with ``requests=`` each request
takes its own path, and a forward with both is hybrid (``path.request_paths``, ``path.owner_tokens``).

The runtime is a facade over its parts, one module each (docs/design.md, "The runtime"): `Forward` (one
forward, its methods in the order of the work) hands each layer's ops a `LayerTurn`; the path choice,
the protocol, the agreement, the packed blocks, the owner exchange, the transport, `Health` and the
`DeviceAPI` (the tests' faults subclass it) are its parts.

Invariants:
- Every rank issues its collectives from the forward's thread in plan order, interleaved with its
  other collectives exactly as the graph orders them (no transfer thread).
- Every rank raises the same named error at the same op (`kvpp_fx.runtime.errors`).
- Nothing issued is cancelled; a failure that may leave the group out of step breaks the runtime for
  good, and every later forward raises `RuntimeBrokenError` naming the first cause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from kvpp_fx.cache.allocate import CacheStorage
from kvpp_fx.cache.cost import BROADCAST, AttentionShape, LinkModel, RequestRows, StepLoad
from kvpp_fx.cache.placement import DEFAULT_CROSSOVER_FRACTION, KVPPPlan
from kvpp_fx.runtime.collectives import Collectives
from kvpp_fx.runtime.current import CURRENT, active_runtime, current_runtime
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import (
    KVPPRuntimeClosed,
    NestedForwardError,
    NoActiveForwardError,
    UnsupportedPlanError,
)
from kvpp_fx.runtime.forward import Forward
from kvpp_fx.runtime.packed_tables import PackedTables
from kvpp_fx.runtime.parts import ForwardParts, Routing, collective_timeout, group_rank
from kvpp_fx.runtime.path import ChosenPath, PathFacts, forward_arguments
from kvpp_fx.runtime.health import Health
from kvpp_fx.runtime.timeline import Timeline
from kvpp_fx.runtime.transport import BroadcastTransport
from kvpp_fx.runtime.turn import LayerTurn

__all__ = ["KVPPRuntime", "active_runtime", "current_runtime"]

class KVPPRuntime:
    def __init__(self, plan: KVPPPlan, storage: CacheStorage, group: Any, rank: int, device_api: DeviceAPI,
                 health: Health, transport: BroadcastTransport | None, timeline: Timeline | None, overlap: bool = True,
                 crossover: float = DEFAULT_CROSSOVER_FRACTION, agreement_group: Any = None,
                 attention: AttentionShape | None = None, link: LinkModel | None = None,
                 exchange_group: Any = None) -> None:
        self.plan = plan
        self.storage = storage
        self.group = group
        self.rank = rank
        self.api = device_api
        self.transport = transport
        self.timeline = timeline
        self.overlap = overlap
        self.crossover = crossover
        self.attention = attention
        self.link = link or LinkModel()
        self.health = health
        self.parts = ForwardParts.assemble(plan, storage, group, rank, device_api, health, transport, timeline, overlap,
                                           agreement_group, attention, exchange_group)
        self._forwards = 0
        self._routing = Routing(plan.target_layers)  # what the engine reported for each layer's compiled graph
        self._forward: Forward | None = None
        self._path: ChosenPath | None = None  # the open forward's
        self._closed = False

    @classmethod
    def create(cls, plan: KVPPPlan, storage: CacheStorage, group: Any = None, *,
               timeline: Timeline | None = None, overlap: bool = True, timeout: timedelta | float | None = None,
               device_api: DeviceAPI | None = None, crossover: float = DEFAULT_CROSSOVER_FRACTION,
               agreement_group: Any = None, attention: AttentionShape | None = None,
               link: LinkModel | None = None, exchange_group: Any = None) -> KVPPRuntime:
        """`group` is this rank's KVPP process group (None only for a group of one).

        ``timeout`` bounds every collective (seconds or a timedelta); by default the group's own
        timeout. ``overlap=False`` completes each broadcast inside its prefetch, a layer's and a prefill
        history chunk's issued ahead alike: the same bytes move, nothing hides behind compute (a baseline
        for benchmarks).
        ``device_api`` replaces the device API: the seam through which tests record device ordering and
        inject faults (`DeviceAPI`; ``kvpp_fx.runtime.device.resolve_device_api`` builds one from a name).
        ``crossover``: the fraction of the pool above which an active-block set is sent whole-layer.
        ``agreement_group``: a host-side (gloo) group of the same ranks for the per-forward agreement, so
        that on a device it needs no host synchronisation (default: `group`, on the cache's device).
        ``attention``: what owner mode ships per query token and head; with ``link``, the cost model
        behind ``forward(mode="auto")`` (which needs it).
        ``exchange_group``: a second group of the same ranks for owner mode's exchanges (default: `group`).
        One communicator runs its collectives in issue order, so on one group a layer's exchange queues
        behind the next layer's broadcast, issued before it; on its own group it does not.
        """
        if not 0.0 <= crossover <= 1.0:
            raise ValueError(f"crossover must be a fraction in [0, 1], got {crossover!r}.")
        if plan.shard_draft_layers and plan.spec.draft_layers:
            raise UnsupportedPlanError(
                "shard_draft_layers=True is a planning what-if only: draft layers stay local on every "
                "rank at runtime. Build the plan with shard_draft_layers=False.")
        rank = group_rank(plan, storage, group, agreement=agreement_group, exchange=exchange_group)
        api = device_api if device_api is not None else DeviceAPI(storage.device)
        health = Health(rank)
        transport = None
        if group is not None and plan.enabled:
            timeout = collective_timeout(timeout, group, storage.device)
            transport = BroadcastTransport(group, api, plan.depth, Collectives(api, timeout, health))
        if attention is not None and plan.enabled:
            attention.split(plan.group_size)  # owner mode needs the heads to split evenly
        return cls(plan, storage, group, rank, api, health, transport, timeline, overlap, crossover, agreement_group,
                   attention, link, exchange_group)

    # --- views ------------------------------------------------------------------------------------

    def view(self, layer: int) -> torch.Tensor:
        return self.storage.byte_view(layer)

    def typed_views(self, layer: int) -> dict[str, torch.Tensor]:
        return self.storage.typed_views(layer)

    def handles(self, layer: int) -> dict[str, torch.Tensor]:
        """What a compiled model takes as the layer's caches; see `CacheStorage.handles`."""
        return self.storage.handles(layer)

    # --- routing (reported by whoever compiles the model: the engine or the runner) --------------------

    def note_routing(self, layers: Sequence[int], routed: bool) -> None:
        """A graph holding `layers` was compiled, routed for owner mode or not (an unreported layer
        counts as unknown: ``"auto"`` broadcasts until every layer is known to be routed)."""
        self._routing.note(layers, routed)

    def routing(self) -> dict[int, bool]:
        """Each reported layer's routing: True (owner mode possible), False (broadcast only)."""
        return dict(self._routing.reported)

    def unrouted_layers(self) -> list[int]:
        """Layers whose compiled graph is known not to be routed: owner mode is refused up front."""
        return list(self._routing.unrouted())

    # --- the forward --------------------------------------------------------------------------------

    @property
    def broken(self) -> BaseException | None:
        """The first failure that broke the runtime, or None."""
        return self.health.cause

    @property
    def path(self) -> ChosenPath | None:
        """The current forward's path (its mode, each request's path, what it packs), or None outside one."""
        return self._path

    @property
    def open_turn(self) -> LayerTurn | None:
        """Inside a forward, the turn its last wait opened (None before the first): what a hook below the
        graph (vLLM's MLA impl, a cache write) acts on, after checking that it is its own layer's."""
        return self._current().open_turn()

    @property
    def packed_tables(self) -> PackedTables | None:
        """Inside a forward that packs blocks into the scratch slots, its remap of block tables and slot
        mappings (`PackedTables`), one per forward: a caller that hands tables to many layers before they
        run remaps them once, and keeps them for the layers this rank does not own. None otherwise."""
        return self._current().packed_tables()

    def owns(self, layer: int) -> bool:
        return self.plan.owners[layer] == self.rank

    @contextlib.contextmanager
    def forward(self, has_history: bool, blocks: Any = None, *, written: Any = None, mode: str = BROADCAST,
                load: StepLoad | None = None,
                requests: Sequence[RequestRows] | None = None,
                history_ahead: bool = False,
                on_turn: Callable[[LayerTurn], None] | None = None) -> Iterator[KVPPRuntime]:
        """One model forward. ``blocks``: ids of the blocks the step reads that hold tokens computed
        before it (every rank must pass the same set); None sends whole layers (whole-layer slots
        only). ``written``: the blocks the step writes that hold no history; they take positions after
        the history blocks in a non-owner's packed slot (`tables`), so a step that writes a block it
        does not list drops that write on non-owners and cannot read it there.

        ``mode``: ``"broadcast"`` (each layer's cache travels to the ranks), ``"owner"`` (each layer's
        attention runs on its owner over every rank's heads; queries and outputs travel), or ``"auto"``
        (the cheaper of the two for this step by the cost model, which needs ``load`` and the runtime's
        ``attention`` shape). Every rank must pass the same mode and load.

        ``requests`` (instead of ``blocks`` and ``load``): the step's requests' rows, each with the
        blocks it reads; each request then takes its own path (`kvpp_fx.cache.cost.choose_rows`):
        "broadcast" sends every request's blocks, "owner" every owner-capable request's rows to the
        owner, "auto" the cheaper per request. Requests of both kinds make a hybrid forward, in which
        the layer's op sends its owner rows through its turn's `owner_compute` (``path.request_paths`` says which).

        ``history_ahead``: the first chunk of a layer's streamed history may be gathered by its owner while
        the previous layer computes (`ContextRows`), before this step writes that layer's cache: true only
        where no streamed history row is one this step writes. Every rank must pass the same value.

        ``on_turn``: handed each layer's turn as its wait opens it, whoever waits (a graph's op, or a hook's
        ``enter_layer``): how code below the graph gets the turn it acts on without asking for it.
        """
        if self._closed:
            raise KVPPRuntimeClosed("this KVPPRuntime was closed.")
        self.health.check()
        if self._forward is not None:
            raise NestedForwardError("runtime.forward() is already open.")
        if self.parts.checks:
            self.parts.checks.read_ready()  # earlier forwards' device checks that completed; never waits
        facts = PathFacts.of(self.plan, self.storage, self.parts.places, self._routing, alone=self.transport is None,
                             attention=self.attention, link=self.link, crossover=self.crossover)
        self._forwards += 1
        arguments = forward_arguments(has_history, blocks, written, mode, load, requests, history_ahead)
        forward = Forward(self.parts, arguments, facts, self._forwards, on_turn)
        try:
            path = forward.begin()
        except BaseException as exc:
            forward.end(exc)  # an agreement it issued completes; nothing else was issued
            raise
        self._forward, self._path = forward, path
        token = CURRENT.set(self)
        try:
            yield self
        except BaseException as exc:
            self._forward = self._path = None
            forward.end(exc)
            raise
        else:
            self._forward = self._path = None
            forward.end(None)
        finally:
            CURRENT.reset(token)

    def _current(self) -> Forward:
        forward = self._forward
        if forward is None or CURRENT.get() is not self:
            raise NoActiveForwardError("kvpp ops ran outside `with runtime.forward(has_history):`.")
        if self.health.cause is not None:
            self.health.check()
        return forward

    # --- the ops ------------------------------------------------------------------------------------

    def prefetch(self, layer: int, slot: int) -> None:
        self._current().prefetch(layer, slot)

    def wait(self, layer: int, slot: int, *, routed: bool = False) -> LayerTurn:
        """Complete `layer`'s broadcast and open its turn, which the next layer's wait closes; returns it."""
        return self._current().wait(layer, slot, routed)

    def enter_layer(self, layer: int, *, routed: bool = False) -> LayerTurn | None:
        """The plan's schedule for `layer`, run when a graph compiled for any layer reaches it (its layer
        is a run-time value): the first layer's prefetch when no graph issued it, the layer's wait, the
        next layer's prefetch, each checked as the graph's own ops would be. Returns the layer's turn;
        None for a local draft layer, which has nothing to wait for. ``routed``: the layer's ops send
        their owner rows through their turn's `owner_compute` themselves (a hook below the graph, as
        vLLM's MLA layers have)."""
        return self._current().enter_layer(layer, routed)

    @property
    def forwards(self) -> int:
        """Forwards begun so far: the number `settle` takes."""
        return self._forwards

    @property
    def pending_checks(self) -> int:
        """Forwards whose device checks are left to read (`settle`); always 0 on CPU."""
        return len(self.parts.checks)

    def settle(self, upto: int | None = None) -> None:
        """Read what the device checked in the forwards up to number `upto` (None: all), waiting for it
        where it has not finished; raises the check's named error (which broke the runtime) if one
        failed. Call it before using those forwards' results, where the host has waited for the device
        anyway (on CPU nothing is left to read: every check is read where it is computed)."""
        self.parts.checks.settle(upto)

    # --- counters and lifetime ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Totals, per-layer totals and the last forward; O(layers) whatever the number of forwards.

        Keys: ``forwards`` (count), ``modes`` ({broadcast, owner}: forwards per mode), ``broadcasts``,
        ``exchanges`` (owner-mode gathers and scatters, one per layer and forward), ``bytes`` (sent or
        received by this rank), ``per_layer`` ({layer: {broadcasts, exchanges, bytes}}),
        ``last_forward`` ({has_history, mode, broadcasts, exchanges, bytes, layers, choice} or None),
        ``broken`` (the first cause, or None), and the allocation.
        """
        return self.parts.stats.snapshot(rank=self.rank, allocated_bytes=self.storage.allocated_bytes,
                                      persistent_layers=list(self.storage.persistent_layers),
                                      scratch_buffers=len(self.storage.scratch), broken=self.health.describe())

    def last_forward(self) -> dict[str, Any] | None:
        """What the last completed forward moved: {has_history, mode, broadcasts, exchanges, bytes, layers,
        choice}."""
        last = self.parts.stats.last
        return last.as_dict() if last is not None else None

    def close(self) -> None:
        """Release the runtime; a broadcast still in flight gets at most the timeout to complete."""
        if self._closed:
            return
        self._closed = True
        if self._forward is not None:
            self._forward.abandon()
        try:
            self.parts.checks.settle()  # a failure of the last forwards is reported, not dropped
        except Exception:  # noqa: BLE001 - it broke the runtime, which is closing; Health logged it
            pass

    def __enter__(self) -> KVPPRuntime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
