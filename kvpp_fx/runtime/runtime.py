"""`KVPPRuntime`: the object users hold. It owns every cache byte of its rank and serves the ops.

Per forward (``with runtime.forward(has_history): ...``) the graph calls, for the target layers in plan
order: ``prefetch(first)``, then ``wait(L)`` followed by ``prefetch(next)``. ``prefetch`` issues the
layer's broadcast on the calling thread and returns at once; ``wait`` makes the compute stream wait for
it and returns the view attention must read: persistent on the owner, the layer's scratch slot
elsewhere. A broadcast-mode forward without history moves no bytes.

Owner mode (``forward(..., mode="owner", load=...)``): no broadcast is issued; each routed
head-separable op gathers every rank's query heads to the layer's owner, runs there over all heads
against the persistent cache, and scatters each rank its part of the output (`owner_compute`);
owner-local ops (the writes) run on the owner only. The exchanges happen whether or not the step has
history. ``mode="auto"`` picks per forward with the cost model (`kvpp_fx.cache.cost`), and owner mode
only for layers the backend reported as routed.

Active blocks: ``forward(has_history, blocks=ids)`` names the blocks the step reads that hold tokens
computed before it. Then each layer's owner gathers those blocks of every component (and their ids)
into its staging buffer, one broadcast carries them, and receivers scatter them into the layer's slot
at the same ids; blocks outside the set are not sent. A set larger than the staging capacity or the
crossover fraction of the pool is sent as whole layers.

Agreement: each forward of an enabled group starts with one small all-reduce of (history, whole,
active or owner mode, set size, digest of the set, query tokens of the load), so ranks that disagree
on what the forward moves raise
`BlockSetMismatchError` together, before any byte moves. Receivers also check the ids that arrive
with each active-block broadcast (on CPU at the wait, on a device when the forward ends).

Invariants:
- Every rank issues its broadcasts from the forward's thread in plan order, interleaved with its other
  collectives exactly as the graph orders them (no transfer thread).
- The protocol is checked at each op from plan data only, so every rank raises the same named error
  at the same op: at most one broadcast in flight; ``prefetch`` names the plan's next layer; it never
  targets the slot of the in-flight or the last awaited layer; ``wait`` names the in-flight layer.
- Nothing issued is cancelled. A forward that ends with a broadcast in flight completes it within the
  timeout. A failed or timed-out broadcast or owner-mode exchange, or a forward that raised after
  issuing any, breaks the runtime: a peer may have paired that broadcast with a different collective, so no later
  byte can be trusted. Every later forward raises `RuntimeBrokenError` naming the first cause.
  Recovery is a new process group and a new runtime.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvpp_fx.cache.allocate import CacheStorage
from kvpp_fx.cache.cost import BROADCAST, MODES, OWNER, AttentionShape, LinkModel, StepLoad, choose_mode
from kvpp_fx.cache.placement import BLOCK_ID_BYTES, DEFAULT_CROSSOVER_FRACTION, KVPPPlan
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import (
    BlockSetMismatchError,
    InvalidBlocksError,
    KVPPRuntimeClosed,
    NestedForwardError,
    NoActiveForwardError,
    OwnerModeUnsupportedError,
    OwnerRoutingError,
    PrefetchOrderError,
    PrefetchPendingError,
    RuntimeBrokenError,
    SkippedLayerError,
    SlotBusyError,
    SlotMismatchError,
    TransferFailedError,
    UnknownLayerError,
    UnsupportedPlanError,
    WaitMismatchError,
)
from kvpp_fx.runtime.stats import TransferStats
from kvpp_fx.runtime.timeline import Timeline
from kvpp_fx.runtime.transport import BroadcastTransport, InFlight

_NO_HISTORY, _WHOLE_LAYERS, _ACTIVE_BLOCKS, _OWNER = 0, 1, 2, 3

logger = logging.getLogger(__name__)

# Test-only faults, for negative controls: "drop-block" leaves the highest id out of every active set;
# "swap-heads" makes owners return each rank another rank's heads; "skip-gather" makes owners compute
# with their own queries in place of the other ranks' (no gather is issued on any rank).
FAULT_ENV = "KVPP_TEST_FAULT"

_CURRENT: contextvars.ContextVar[KVPPRuntime | None] = contextvars.ContextVar("kvpp_runtime", default=None)


def active_runtime() -> KVPPRuntime | None:
    """The runtime of the enclosing ``runtime.forward(...)``, or None outside one."""
    return _CURRENT.get()


def current_runtime() -> KVPPRuntime:
    runtime = _CURRENT.get()
    if runtime is None:
        raise NoActiveForwardError(
            "kvpp.prefetch/kvpp.wait ran outside `with runtime.forward(has_history):`.")
    return runtime


def group_timeout(group: Any, device: torch.device) -> timedelta:
    """The timeout the process group was created with (torch's default when it cannot be read)."""
    try:
        return group._get_backend(device).options._timeout
    except Exception:  # private API: fall back rather than fail
        return dist.default_pg_timeout


@dataclass
class _ActiveSet:
    """One forward's active blocks, prepared once on the device: ids and staging views per bundle shape."""

    ids: torch.Tensor
    count: int
    digest: int  # of the sorted ids, for the forward's agreement
    ids_ok: torch.Tensor  # receivers AND in whether each received id list equals their own
    ids_equal: torch.Tensor  # scratch for that comparison, so no layer allocates
    layer_ok: torch.Tensor
    staging: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]


@dataclass
class _Forward:
    has_history: bool
    owner: bool = False  # owner mode: routed cache ops run on each layer's owner; no broadcast
    query_tokens: int = -1  # from the forward's load, when given (owner mode gathers that many per rank)
    last_work: Any = None  # the last owner-mode collective (one communicator completes in order)
    exchange_failed: torch.Tensor | None = None  # on a device: the owners' status values, read at the end
    active: _ActiveSet | None = None
    next_position: int = 0  # plan position of the only layer the next prefetch may name
    in_flight: InFlight | None = None
    last_awaited: int | None = None
    issued: int = 0


class KVPPRuntime:
    def __init__(self, plan: KVPPPlan, storage: CacheStorage, group: Any, rank: int, device_api: DeviceAPI,
                 transport: BroadcastTransport | None, timeline: Timeline | None, overlap: bool = True,
                 crossover: float = DEFAULT_CROSSOVER_FRACTION, agreement_group: Any = None,
                 attention: AttentionShape | None = None, link: LinkModel | None = None) -> None:
        self.plan = plan
        self.storage = storage
        self.group = group
        self.rank = rank
        self.api = device_api
        self.transport = transport
        self.timeline = timeline
        self.overlap = overlap
        targets = plan.target_layers
        self._position = {layer: k for k, layer in enumerate(targets)}
        self._slot = {layer: plan.slot(layer) for layer in targets}
        self._views = {layer: storage.byte_view(layer) for layer in targets}
        self._src = ({layer: dist.get_global_rank(group, plan.owners[layer]) for layer in targets}
                     if group is not None else {})
        self._owned = {layer: plan.owners[layer] == rank for layer in targets}
        self._block_views = {layer: storage.block_views(layer) for layer in targets}
        self._shape = {layer: tuple(v.shape[1] for v in self._block_views[layer]) for layer in targets}
        self.crossover = crossover
        self._fault = os.environ.get(FAULT_ENV, "")
        self._agreement_group = agreement_group
        self.attention = attention
        self.link = link or LinkModel()
        self._routed: dict[int, bool] = {}  # what the backend reported for each layer's compiled graph
        self._stats = TransferStats(targets)
        self._forward: _Forward | None = None
        self._broken: BaseException | None = None
        self._closed = False

    @classmethod
    def create(cls, plan: KVPPPlan, storage: CacheStorage, group: Any = None, *,
               delay: Callable[[int], float] | None = None, timeline: Timeline | None = None,
               overlap: bool = True, timeout: timedelta | float | None = None,
               device_api: DeviceAPI | None = None, crossover: float = DEFAULT_CROSSOVER_FRACTION,
               agreement_group: Any = None, attention: AttentionShape | None = None,
               link: LinkModel | None = None) -> KVPPRuntime:
        """`group` is this rank's KVPP process group (None only for a group of one).

        ``timeout`` bounds every broadcast (seconds or a timedelta); by default the group's own
        timeout. ``overlap=False`` completes each broadcast inside its prefetch: the same bytes move,
        nothing hides behind compute (a baseline for benchmarks). ``delay(layer)`` returns seconds to
        sleep before issuing a broadcast (a test hook; also ``KVPP_TRANSPORT_DELAY_MS``).
        ``device_api`` replaces the device API (tests record device ordering through it).
        ``crossover``: the fraction of the pool above which an active-block set is sent whole-layer.
        ``agreement_group``: a host-side (gloo) group of the same ranks for the per-forward agreement, so
        that on a device it needs no host synchronisation (default: `group`, on the cache's device).
        ``attention``: what owner mode ships per query token and head; with ``link``, the cost model
        behind ``forward(mode="auto")`` (which needs it).
        """
        if not 0.0 <= crossover <= 1.0:
            raise ValueError(f"crossover must be a fraction in [0, 1], got {crossover!r}.")
        if plan.shard_draft_layers and plan.spec.draft_layers:
            raise UnsupportedPlanError(
                "shard_draft_layers=True is a planning what-if only: draft layers stay local on every "
                "rank at runtime. Build the plan with shard_draft_layers=False.")
        if group is None:
            if plan.group_size != 1:
                raise ValueError(f"a KVPP group of size {plan.group_size} needs a process group.")
            rank = 0
        else:
            if dist.get_world_size(group) != plan.group_size:
                raise ValueError(f"the process group has {dist.get_world_size(group)} ranks, "
                                 f"the plan {plan.group_size}.")
            rank = dist.get_rank(group)
        if storage.rank != rank or storage.plan is not plan:
            raise ValueError(f"storage was allocated for rank {storage.rank} of another plan, "
                             f"this is rank {rank}.")
        api = device_api if device_api is not None else DeviceAPI(storage.device)
        transport = None
        if group is not None and plan.enabled:
            if timeout is None:
                timeout = group_timeout(group, storage.device)
            elif not isinstance(timeout, timedelta):
                timeout = timedelta(seconds=float(timeout))
            if timeout.total_seconds() <= 0:
                raise ValueError(f"timeout must be positive, got {timeout}.")
            transport = BroadcastTransport(group, api, plan.depth, timeout, delay=delay)
        if agreement_group is not None and (sorted(dist.get_process_group_ranks(agreement_group))
                                            != sorted(dist.get_process_group_ranks(group))):
            raise ValueError(f"the agreement group's ranks {dist.get_process_group_ranks(agreement_group)} "
                             f"differ from the KVPP group's {dist.get_process_group_ranks(group)}.")
        if attention is not None and plan.enabled:
            attention.split(plan.group_size)  # owner mode needs the heads to split evenly
        return cls(plan, storage, group, rank, api, transport, timeline, overlap, crossover, agreement_group,
                   attention, link)

    # --- views ------------------------------------------------------------------------------------

    def view(self, layer: int) -> torch.Tensor:
        return self.storage.byte_view(layer)

    def typed_views(self, layer: int) -> dict[str, torch.Tensor]:
        return self.storage.typed_views(layer)

    def handles(self, layer: int) -> dict[str, torch.Tensor]:
        """What a compiled model takes as the layer's caches; see `CacheStorage.handles`."""
        return self.storage.handles(layer)

    # --- the forward context ------------------------------------------------------------------------

    @property
    def broken(self) -> BaseException | None:
        """The first failure that broke the runtime, or None."""
        return self._broken

    def note_routing(self, layers: tuple[int, ...], routed: bool) -> None:
        """The backend compiled a graph holding `layers`, routed for owner mode or not (a graph compiled
        under this runtime's forward reports it; an unreported layer counts as unknown)."""
        for layer in layers:
            self._routed[layer] = routed

    def routing(self) -> dict[int, bool]:
        """Each layer's reported routing: True (owner mode possible), False (broadcast only)."""
        return dict(self._routed)

    def _unrouted_layers(self) -> list[int]:
        return [layer for layer in self.plan.target_layers if self._routed.get(layer) is False]

    @property
    def owner_mode(self) -> bool:
        """True inside a forward that runs in owner mode."""
        state = self._forward
        return state is not None and state.owner

    @contextlib.contextmanager
    def forward(self, has_history: bool, blocks: Any = None, *, mode: str = BROADCAST,
                load: StepLoad | None = None) -> Iterator[KVPPRuntime]:
        """One model forward. ``blocks``: ids of the blocks the step reads that hold tokens computed
        before it (every rank must pass the same set); None sends whole layers.

        ``mode``: ``"broadcast"`` (each layer's cache travels to the ranks), ``"owner"`` (each layer's
        attention runs on its owner over every rank's heads; queries and outputs travel), or ``"auto"``
        (the cheaper of the two for this step by the cost model, which needs ``load`` and the runtime's
        ``attention`` shape). Every rank must pass the same mode and load.
        """
        if self._closed:
            raise KVPPRuntimeClosed("this KVPPRuntime was closed.")
        self._raise_if_broken()
        if self._forward is not None:
            raise NestedForwardError("runtime.forward() is already open.")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        state = _Forward(has_history=bool(has_history) and self.transport is not None,
                         query_tokens=load.query_tokens if load is not None else -1)
        if state.has_history and blocks is not None:
            state.active = self._prepare_active(blocks)
        choice = None
        if self.transport is None:
            mode = BROADCAST  # a group of one: every cache is local, nothing moves in either mode
        elif mode == "auto":
            choice = self._choose(state, load)
            mode = choice["mode"]
        state.owner = mode == OWNER
        unrouted = self._unrouted_layers() if state.owner else []
        if unrouted:
            raise OwnerModeUnsupportedError(
                f"owner mode was asked, but the compiled graph of layers {unrouted} is not routed "
                "for it (one of its cache ops declares no owner rule in its AttentionOpSpec); nothing was moved. "
                'Use mode="broadcast" or "auto", or declare the ops and recompile.')
        if state.owner and load is None:
            raise OwnerModeUnsupportedError(
                "owner mode needs the step's load (forward(..., load=StepLoad(query_tokens, attention_pairs))): "
                "every rank gathers that many query tokens, and the ranks agree on it first.")
        if state.owner:
            state.active = None  # owner mode reads the owner's persistent cache; no block moves
        if self.transport is not None:
            self._agree(state)
        self._forward = state
        self._stats.begin_forward(state.has_history, mode, choice)
        token = _CURRENT.set(self)
        try:
            yield self
        except BaseException as exc:
            self._end(state, exc)
            raise
        else:
            self._end(state, None)
        finally:
            _CURRENT.reset(token)

    def _end(self, state: _Forward, exc: BaseException | None) -> None:
        """Complete what is in flight, break the runtime where the group may be out of step."""
        self._forward = None
        flight, state.in_flight = state.in_flight, None
        try:
            if flight is not None and flight.work is not None:
                try:
                    self.transport.complete_on_host(flight)
                    self._stats.record(flight.layer, flight.nbytes)
                except TransferFailedError as failure:
                    self._break(failure)
                    if exc is None:
                        raise
            if state.last_work is not None:  # on a device the exchanges were waited for by the stream only
                try:
                    self.transport.complete_work_on_host(state.last_work, "the forward's last owner-mode exchange")
                except TransferFailedError as failure:
                    self._break(failure)
                    if exc is None:
                        raise
            if exc is not None:
                if state.issued:
                    self._break(exc)
                return
            self._raise_if_broken()  # a failure inside this forward was caught by the caller
            if state.exchange_failed is not None and bool(state.exchange_failed.item()):
                error = OwnerRoutingError("an owner failed to compute a layer in this forward; this rank's "
                                          "outputs of that layer are zeros.")
                self._break(error)
                raise error
            if (state.active is not None and state.issued and self.storage.device.type != "cpu"
                    and not bool(state.active.ids_ok.item())):
                self._mispaired(None)  # on a device the received ids are checked once, here
            missing = len(self.plan.target_layers) - state.next_position
            if missing:
                skipped = list(self.plan.target_layers[state.next_position:])
                error = SkippedLayerError(
                    f"the forward ended without awaiting layers {skipped}; every target layer must be "
                    "awaited once per forward.")
                if state.issued:
                    self._break(error)
                raise error
        finally:
            self._stats.end_forward()

    def _break(self, cause: BaseException) -> None:
        if self._broken is None:
            self._broken = cause
            logger.error("KVPP runtime on rank %d is broken: %s: %s", self.rank, type(cause).__name__, cause)

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            cause = self._broken
            raise RuntimeBrokenError(
                f"this KVPPRuntime is broken since {type(cause).__name__}: {cause}. The group's broadcast "
                "sequence can no longer be trusted; create a new process group and a new KVPPRuntime."
            ) from cause

    def _active(self) -> _Forward:
        state = self._forward
        if state is None or _CURRENT.get() is not self:
            raise NoActiveForwardError("kvpp ops ran outside `with runtime.forward(has_history):`.")
        self._raise_if_broken()
        return state

    def _position_of(self, layer: int, slot: int) -> int:
        position = self._position.get(layer)
        if position is None:
            kind = "a local draft layer" if layer in self.plan.local_draft_layers else "not a target layer"
            raise UnknownLayerError(f"layer {layer} is not a broadcast layer of this plan ({kind}; "
                                    f"targets: {list(self.plan.target_layers)}).")
        if slot != self._slot[layer]:
            raise SlotMismatchError(f"layer {layer} uses slot {self._slot[layer]}, the graph asked "
                                    f"for slot {slot}.")
        return position

    def _choose(self, state: _Forward, load: StepLoad | None) -> dict[str, Any]:
        """``mode="auto"``: the cost model's choice for this step, and both sides of the comparison."""
        if self.attention is None or load is None:
            missing = "an attention shape (KVPPRuntime.create(attention=...))" if self.attention is None \
                else "the step's load (forward(..., load=StepLoad(...)))"
            raise OwnerModeUnsupportedError(f'mode="auto" needs {missing} to compare the two modes.')
        unknown = [layer for layer in self.plan.target_layers if not self._routed.get(layer, False)]
        if unknown:
            return {"mode": BROADCAST, "why": f"layers {unknown} are not known to be routed for owner mode"}
        broadcast = 0
        if state.has_history:
            first = self.plan.target_layers[0]
            broadcast = (self.plan.active_broadcast_bytes(first, state.active.count) if state.active is not None
                         else self._views[first].numel() * self._views[first].element_size())
        return dataclasses.asdict(choose_mode(self.attention, load, broadcast, self.plan.group_size, self.link))

    def _agree(self, state: _Forward) -> None:
        """All ranks must agree on what this forward moves before anything moves (one small all-reduce)."""
        active = state.active
        mode = (_OWNER if state.owner else _NO_HISTORY if not state.has_history
                else _ACTIVE_BLOCKS if active is not None else _WHOLE_LAYERS)
        count, digest = (active.count, active.digest) if active is not None else (0, 0)
        mine = torch.tensor([mode, count, digest, state.query_tokens], dtype=torch.int64)
        group = self._agreement_group
        extremes = torch.cat([mine, -mine])
        if group is None:
            group, extremes = self.group, extremes.to(self.storage.device)
        try:
            work = self.api.all_reduce_max(extremes, group)
            self.transport.complete_work_on_host(work, "the forward's agreement")
        except TransferFailedError as exc:
            self._break(exc)
            raise
        high, low = extremes.cpu().view(2, 4)
        if not torch.equal(high, -low):
            names = ("history and path (0 none, 1 whole layers, 2 active blocks, 3 owner mode)", "active-block count",
                     "active-block set", "query tokens (the load)")
            differing = [n for n, h, l in zip(names, high.tolist(), (-low).tolist()) if h != l]
            raise BlockSetMismatchError(
                f"the ranks disagree on this forward's {', '.join(differing)}; every rank must pass the same "
                f"has_history, blocks, mode and load to runtime.forward() (this rank: path {mode}, {count} blocks). "
                "Nothing was moved.")

    def _mispaired(self, layer: int | None) -> None:
        where = f"with layer {layer}'s broadcast" if layer is not None else "in this forward"
        error = BlockSetMismatchError(
            f"the block ids received {where} are not this forward's set: the broadcast paired with another "
            "forward's or another rank's; this rank's view of the group can no longer be trusted.")
        self._break(error)
        raise error

    def _prepare_active(self, blocks: Any) -> _ActiveSet | None:
        """Validate the set and build its device index and staging views; None means whole layers."""
        num_blocks = self.storage.num_blocks
        try:
            ids = sorted({int(b) for b in (blocks.tolist() if isinstance(blocks, torch.Tensor) else blocks)})
        except (TypeError, ValueError):
            raise InvalidBlocksError(f"blocks must be an iterable of block ids, got {blocks!r}.") from None
        if ids and (ids[0] < 0 or ids[-1] >= num_blocks):
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise InvalidBlocksError(f"block id {bad} is outside the pool of {num_blocks} blocks.")
        if self._fault == "drop-block" and ids:
            ids.pop()
        count = len(ids)
        if not self.plan.uses_active_blocks(count, num_blocks, self.crossover):
            return None
        device = self.storage.device
        staging = {}
        for shape in set(self._shape.values()):
            header = self.storage.staging[: count * BLOCK_ID_BYTES].view(torch.int64)
            offset, parts = count * BLOCK_ID_BYTES, []
            for width in shape:
                parts.append(self.storage.staging[offset: offset + count * width].view(count, width))
                offset += count * width
            staging[shape] = (self.storage.staging[:offset], header, parts)
        digest = int.from_bytes(hashlib.blake2b(repr(ids).encode(), digest_size=8).digest(), "little") >> 2
        return _ActiveSet(torch.tensor(ids, dtype=torch.int64, device=device), count, digest,
                          torch.ones((), dtype=torch.bool, device=device),
                          torch.empty(count, dtype=torch.bool, device=device),
                          torch.empty((), dtype=torch.bool, device=device), staging)

    def _issue(self, state: _Forward, layer: int, slot: int) -> InFlight:
        active = state.active
        if active is None:
            return self.transport.issue(layer, slot, self._views[layer], self._src[layer])
        if active.count == 0:  # the step reads no block with history: nothing to move
            return InFlight(layer, slot, 0, None, time.perf_counter_ns())
        payload, header, parts = active.staging[self._shape[layer]]
        sources = self._block_views[layer]
        if self._owned[layer]:
            def pack() -> None:
                header.copy_(active.ids)
                for source, part in zip(sources, parts):
                    self.api.gather_blocks(source, active.ids, part)

            return self.transport.issue(layer, slot, payload, self._src[layer], pack=pack)

        def unpack() -> None:
            torch.eq(header, active.ids, out=active.ids_equal)
            torch.all(active.ids_equal, out=active.layer_ok)
            active.ids_ok.logical_and_(active.layer_ok)  # read on the host when the forward ends
            for dest, part in zip(sources, parts):
                self.api.scatter_blocks(dest, active.ids, part)

        return self.transport.issue(layer, slot, payload, self._src[layer], unpack=unpack)

    # --- the two ops ------------------------------------------------------------------------------

    def prefetch(self, layer: int, slot: int) -> None:
        start = time.perf_counter_ns()
        state = self._active()
        busy = state.in_flight
        if busy is not None:
            kind = SlotBusyError if busy.slot == slot else PrefetchPendingError
            raise kind(f"prefetch of layer {layer} (slot {slot}) while layer {busy.layer} "
                       f"(slot {busy.slot}) is still pending.")
        last = state.last_awaited
        if last is not None and self._slot[last] == slot:
            raise SlotBusyError(f"prefetch of layer {layer} into slot {slot}, which layer {last}'s attention "
                                "is still reading.")
        position = self._position_of(layer, slot)
        if position != state.next_position:
            targets = self.plan.target_layers
            if position > state.next_position:
                raise SkippedLayerError(
                    f"prefetch of layer {layer} skips layers {list(targets[state.next_position:position])}; "
                    "layers must follow the plan's execution order on every rank.")
            after = targets[state.next_position - 1]
            raise PrefetchOrderError(f"layer {layer} prefetched after layer {after}; layers must follow the "
                                     "plan's execution order on every rank.")
        flight = InFlight(layer, slot, 0, None, start)
        if state.has_history and not state.owner:
            state.issued += 1  # counted first: a failure while issuing may have left a peer's half pending
            flight = self._issue(state, layer, slot)
        state.in_flight = flight
        if not self.overlap:
            self._complete(flight)
        if self.timeline is not None:
            self.timeline.add(f"prefetch L{layer}", "prefetch", start, time.perf_counter_ns(),
                              layer=layer, slot=slot, communicate=state.has_history)

    def wait(self, layer: int, slot: int, *, routed: bool = False) -> torch.Tensor:
        start = time.perf_counter_ns()
        state = self._active()
        position = self._position_of(layer, slot)
        if state.owner and not routed:
            error = OwnerModeUnsupportedError(
                f"owner mode reached layer {layer}, whose cache ops the graph does not route for it (an op "
                "without an owner rule in its AttentionOpSpec, or a graph rewritten before owner mode); "
                "its attention would read a scratch slot that owner mode does not fill. Use "
                'mode="broadcast", or declare the ops (HeadSeparable / OwnerLocal) and recompile.')
            if state.issued:
                self._break(error)
            raise error
        flight = state.in_flight
        if flight is None or flight.layer != layer:
            expected = "nothing is pending" if flight is None else f"layer {flight.layer} is pending"
            raise WaitMismatchError(f"wait for layer {layer}, but {expected}.")
        state.in_flight = None
        self._complete(flight)
        state.last_awaited = layer
        state.next_position = position + 1
        if self.timeline is not None:
            self.timeline.add(f"wait L{layer}", "wait", start, time.perf_counter_ns(), layer=layer)
        return self._views[layer]

    def _complete(self, flight: InFlight) -> None:
        if flight.work is None:
            return
        try:
            self.transport.complete(flight)
        except TransferFailedError as exc:
            self._break(exc)
            raise
        self._stats.record(flight.layer, flight.nbytes)
        active = self._forward.active if self._forward is not None else None
        if (active is not None and flight.unpack is not None and self.storage.device.type == "cpu"
                and not bool(active.layer_ok)):
            self._mispaired(flight.layer)
        if self.timeline is not None:
            self.timeline.add(f"broadcast L{flight.layer}", "broadcast", flight.issued_ns,
                              time.perf_counter_ns(), track="kvpp transfer stream", layer=flight.layer,
                              bytes=flight.nbytes, src=self._src[flight.layer])

    # --- owner mode ---------------------------------------------------------------------------------

    def _owner_turn(self, layer: int) -> _Forward:
        """The owner-mode forward, checked to be inside `layer`'s turn (after its wait, before the next)."""
        state = self._active()
        if state.last_awaited != layer:
            raise OwnerRoutingError(
                f"a routed cache op of layer {layer} ran outside its turn (the last awaited layer is "
                f"{state.last_awaited}); it must follow kvpp.wait of its own layer.")
        return state

    def runs_owner_ops(self, layer: int) -> bool:
        """In owner mode: whether this rank runs `layer`'s owner-local ops (it owns the layer)."""
        self._owner_turn(layer)
        return self._owned[layer]

    def owner_compute(self, layer: int, heads: list[torch.Tensor], dims: list[int], token_dims: list[int],
                      output_dim: int, output_like: int,
                      compute: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """Run a head-separable op of `layer` on its owner over every rank's heads; return this rank's part.

        Every rank packs its head operands into one buffer, which one gather brings to the owner. The
        owner concatenates each operand along its head dimension in rank order, calls ``compute``, splits
        the output along ``output_dim`` and scatters the parts back, each followed by one status value
        (non-zero: the owner failed, and the part is zeros). Both collectives run on the current stream,
        in program order, and the current stream waits for each (the host too, on CPU).

        Before anything is issued, every head operand must hold the forward's agreed query tokens on its
        token dimension (and, with an attention shape, the rank's share of the heads), and all must have
        one dtype: buffers of different sizes would pair wrongly in the gather.
        """
        state = self._owner_turn(layer)
        group_size = self.plan.group_size
        self._check_heads(layer, heads, dims, token_dims, state.query_tokens)
        like = heads[output_like]
        local_heads = like.shape[dims[output_like]]
        owned = self._owned[layer]
        pack = torch.cat([t.contiguous().view(-1) for t in heads]) if len(heads) > 1 else \
            heads[0].contiguous().view(-1)
        nbytes = pack.numel() * pack.element_size() + like.numel() * like.element_size()
        state.issued += 1  # counted first: a failure while issuing may have left a peer's half pending
        owner = self._src[layer]
        start = time.perf_counter_ns()
        gathered = [torch.empty_like(pack) for _ in range(group_size)] if owned else None
        if self._fault == "skip-gather":
            if owned:
                for part in gathered:
                    part.copy_(pack)
        else:
            state.last_work = self._run_collective(lambda: self.api.gather(pack, gathered, owner, self.group),
                                                   f"owner-mode gather of layer {layer}")
        received = torch.empty(like.numel() + 1, dtype=like.dtype, device=like.device)
        parts, failure = None, None
        if owned:
            try:
                parts = self._owner_parts(layer, heads, dims, gathered, compute, like, output_like, output_dim,
                                          local_heads)
            except Exception as exc:  # the other ranks learn it from the scatter instead of a timeout
                failure = exc
                parts = [torch.cat([torch.zeros_like(like).view(-1), like.new_ones(1)]) for _ in range(group_size)]
        state.last_work = self._run_collective(lambda: self.api.scatter(received, parts, owner, self.group),
                                               f"owner-mode scatter of layer {layer}")
        if failure is not None:
            raise failure
        status = received[-1:]
        if self.storage.device.type == "cpu":
            if bool(status.item()):
                raise OwnerRoutingError(f"the owner of layer {layer} failed to compute it (see its error); "
                                        "this rank received no output.")
        else:  # read on the host once, when the forward ends
            state.exchange_failed = status if state.exchange_failed is None else \
                torch.maximum(state.exchange_failed, status)
        self._stats.record_exchange(layer, nbytes * (group_size - 1) if owned else nbytes)
        if self.timeline is not None:
            self.timeline.add(f"exchange L{layer}", "exchange", start, time.perf_counter_ns(),
                              track="kvpp transfer stream", layer=layer, bytes=nbytes, owner=owner)
        return received[:-1].view(like.shape)

    def _check_heads(self, layer: int, heads: list[torch.Tensor], dims: list[int], token_dims: list[int],
                     query_tokens: int) -> None:
        local = self.attention.split(self.plan.group_size) if self.attention is not None else None
        for i, (tensor, dim, token_dim) in enumerate(zip(heads, dims, token_dims)):
            if not (-tensor.dim() <= dim < tensor.dim() and -tensor.dim() <= token_dim < tensor.dim()):
                raise OwnerRoutingError(f"layer {layer}: head operand {i} is {tuple(tensor.shape)}; its declared "
                                        f"head dimension {dim} or token dimension {token_dim} does not exist.")
            if tensor.shape[token_dim] != query_tokens:
                raise OwnerRoutingError(
                    f"layer {layer}: head operand {i} holds {tensor.shape[token_dim]} query tokens, the forward's "
                    f"load {query_tokens}; owner mode gathers equal buffers from every rank.")
            if local is not None and tensor.shape[dim] != local:
                raise OwnerRoutingError(f"layer {layer}: head operand {i} holds {tensor.shape[dim]} heads, the "
                                        f"runtime's attention shape {local} per rank.")
            if tensor.dtype != heads[0].dtype:
                raise OwnerRoutingError(f"layer {layer}: head operands of dtypes {heads[0].dtype} and "
                                        f"{tensor.dtype}; owner mode packs them into one buffer of one dtype.")

    def _owner_parts(self, layer, heads, dims, gathered, compute, like, output_like, output_dim,
                     local_heads) -> list[torch.Tensor]:
        """The owner's side: all heads in rank order, the op, and each rank's part plus a zero status."""
        full, offset = [], 0
        for tensor, dim in zip(heads, dims):
            n = tensor.numel()
            full.append(torch.cat([g[offset:offset + n].view(tensor.shape) for g in gathered], dim=dim))
            offset += n
        out = compute(full)
        expected = list(like.shape)
        expected[output_dim] = local_heads * self.plan.group_size
        if not isinstance(out, torch.Tensor) or list(out.shape) != expected or out.dtype != like.dtype:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise OwnerRoutingError(
                f"layer {layer}: the op's output over all heads is {got}; its declaration says "
                f"{tuple(expected)} {like.dtype} (the shape of head operand {output_like} with heads on "
                f"dimension {output_dim}).")
        zero = like.new_zeros(1)
        parts = [torch.cat([p.contiguous().view(-1), zero]) for p in out.split(local_heads, dim=output_dim)]
        if self._fault == "swap-heads":
            parts = parts[1:] + parts[:1]
        return parts

    def _run_collective(self, issue: Callable[[], Any], what: str) -> Any:
        """Issue a collective and make the current stream wait for it; a failure breaks the runtime."""
        try:
            try:
                work = issue()
            except Exception as exc:
                raise TransferFailedError(f"{what} could not be issued: {exc}") from exc
            self.transport.complete_work(work, what)
        except TransferFailedError as exc:
            self._break(exc)
            raise
        return work

    # --- counters and lifetime ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Totals, per-layer totals and the last forward; O(layers) whatever the number of forwards.

        Keys: ``forwards`` (count), ``modes`` ({broadcast, owner}: forwards per mode), ``broadcasts``,
        ``exchanges`` (owner-mode gathers and scatters, one per layer and forward), ``bytes`` (sent or
        received by this rank), ``per_layer`` ({layer: {broadcasts, exchanges, bytes}}),
        ``last_forward`` ({has_history, mode, broadcasts, exchanges, bytes, layers, choice} or None),
        ``broken`` (the first cause, or None), and the allocation.
        """
        out = self._stats.snapshot()
        out.update(rank=self.rank, allocated_bytes=self.storage.allocated_bytes,
                   persistent_layers=list(self.storage.persistent_layers),
                   scratch_buffers=len(self.storage.scratch),
                   broken=None if self._broken is None else f"{type(self._broken).__name__}: {self._broken}")
        return out

    def last_forward(self) -> dict[str, Any] | None:
        """What the last completed forward moved: {has_history, broadcasts, bytes, layers}."""
        last = self._stats.last
        return last.as_dict() if last is not None else None

    def close(self) -> None:
        """Release the runtime; a broadcast still in flight gets at most the timeout to complete."""
        if self._closed:
            return
        self._closed = True
        state = self._forward
        if state is not None and state.in_flight is not None and state.in_flight.work is not None:
            try:
                self.transport.complete_on_host(state.in_flight)
            except TransferFailedError as exc:
                self._break(exc)
            state.in_flight = None

    def __enter__(self) -> KVPPRuntime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

