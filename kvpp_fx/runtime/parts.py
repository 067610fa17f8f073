"""What every forward of a runtime works with: each target layer's place and turn, and the runtime's parts.

Both are built once per runtime (`ForwardParts.assemble`) and handed to each `Forward`, which reads
nothing else of the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kvpp_fx.runtime.agreement import Agreement
from kvpp_fx.runtime.context_rows import ContextRows
from kvpp_fx.runtime.layer_place import LayerPlace
from kvpp_fx.runtime.pending import PendingChecks
from kvpp_fx.runtime.stats import TransferStats
from kvpp_fx.runtime.turn import LayerTurn
from kvpp_fx.schedule import LayerSchedule
from kvpp_fx.topology import group_timeout

if TYPE_CHECKING:
    from kvpp_fx.cache.allocate import CacheStorage
    from kvpp_fx.cache.cost import AttentionShape
    from kvpp_fx.runtime.device import DeviceAPI
    from kvpp_fx.runtime.health import Health
    from kvpp_fx.runtime.timeline import Timeline
    from kvpp_fx.runtime.transport import BroadcastTransport


@dataclass(frozen=True)
class ForwardParts:
    """What every forward of a runtime works with, built once by the runtime and handed to each."""

    schedule: LayerSchedule
    places: tuple[LayerPlace, ...]
    storage: CacheStorage
    api: DeviceAPI
    transport: BroadcastTransport | None  # None for a group of one
    agreement: Agreement | None  # None for a group of one
    health: Health
    stats: TransferStats
    timeline: Timeline | None
    overlap: bool
    group: dist.ProcessGroup | None
    group_size: int
    attention: AttentionShape | None
    exchange_group: dist.ProcessGroup | None  # owner mode's gathers and scatters: `group`'s ranks, its own communicator
    checks: PendingChecks  # a device's checks of earlier forwards, read later
    context_rows: ContextRows  # prefill history streamed from each layer's owner, inside its turn
    turns: tuple[LayerTurn, ...]  # each target layer's, re-opened by each forward's wait of the layer

    @classmethod
    def assemble(cls, plan: Any, storage: CacheStorage, group: Any, rank: int, api: DeviceAPI, health: Health,
                 transport: BroadcastTransport | None, timeline: Timeline | None, overlap: bool, agreement_group: Any,
                 attention: AttentionShape | None, exchange_group: Any) -> ForwardParts:
        """A runtime's parts: each target layer's place, the agreement (on `agreement_group` when given,
        host-side), the counters and the pending checks."""
        places = tuple(layer_place(plan, storage, group, rank, layer, k) for k, layer in enumerate(plan.target_layers))
        agreement = None
        if transport is not None:
            agreement = Agreement(api, transport.collectives, agreement_group if agreement_group is not None else group,
                                  agreement_group is not None, storage.device)
        stats = TransferStats(plan.target_layers)
        exchange_group = exchange_group if exchange_group is not None else group
        context_rows = ContextRows(api, transport.collectives if transport is not None else None, exchange_group,
                                   plan.group_size, stats, timeline, overlap)
        turns = tuple(LayerTurn(place, places[k + 1] if k + 1 < len(places) else None, context_rows)
                      for k, place in enumerate(places))
        return cls(plan.schedule(), places, storage, api, transport, agreement, health, stats, timeline, overlap,
                   group, plan.group_size, attention, exchange_group, PendingChecks(health), context_rows, turns)


def group_rank(plan: Any, storage: CacheStorage, group: Any, **others: Any) -> int:
    """This rank's index in the KVPP `group` (0 without one), checked against the plan, the storage and the
    `others` groups (by name), which must hold the same ranks."""
    if group is None:
        if plan.group_size != 1:
            raise ValueError(f"a KVPP group of size {plan.group_size} needs a process group.")
        rank = 0
    else:
        if dist.get_world_size(group) != plan.group_size:
            raise ValueError(f"the process group has {dist.get_world_size(group)} ranks, the plan {plan.group_size}.")
        rank = dist.get_rank(group)
    if storage.rank != rank or storage.plan is not plan:
        raise ValueError(f"storage was allocated for rank {storage.rank} of another plan, this is rank {rank}.")
    for name, other in others.items():
        if other is not None and (sorted(dist.get_process_group_ranks(other))
                                  != sorted(dist.get_process_group_ranks(group))):
            raise ValueError(f"the {name} group's ranks {dist.get_process_group_ranks(other)} differ from the "
                             f"KVPP group's {dist.get_process_group_ranks(group)}.")
    return rank


def collective_timeout(timeout: timedelta | float | None, group: Any, device: torch.device) -> timedelta:
    """What bounds every collective: `timeout` (seconds or a timedelta), by default the group's own."""
    if timeout is None:
        return group_timeout(group, device)
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}.")
    return timeout


def layer_place(plan: Any, storage: Any, group: Any, rank: int, layer: int, position: int) -> LayerPlace:
    """`layer`'s place on `rank`: its view, its slot, its owner, its sizes."""
    view = storage.byte_view(layer)
    block_views = tuple(storage.block_views(layer))
    slot, owned = plan.slot(layer), plan.owners[layer] == rank
    # The owner packs into its own slot for the layer, which it never reads for a layer it owns.
    pack_views = tuple(storage.slot_block_views(slot, layer)) if owned and storage.scratch else ()
    src = dist.get_global_rank(group, plan.owners[layer]) if group is not None else 0
    nbytes = storage.num_blocks * plan.bundle_bytes_per_block(layer)  # a whole layer
    return LayerPlace(layer, position, slot, owned, src, view, nbytes, block_views,
                      tuple(v.shape[1] for v in block_views), storage.typed_views(layer), pack_views, (view,))


class Routing:
    """What the engine or runner reported for each target layer's compiled graph: routed for owner mode
    (True), broadcast only (False), or not yet reported. Both lists are kept as reports arrive: every
    forward reads them."""

    def __init__(self, targets: tuple[int, ...]) -> None:
        self.targets = targets
        self.reported: dict[int, bool] = {}
        self._unrouted: tuple[int, ...] = ()
        self._not_known_routed: tuple[int, ...] = tuple(targets)

    def note(self, layers: Any, routed: bool) -> None:
        for layer in layers:
            self.reported[layer] = routed
        self._unrouted = tuple(layer for layer in self.targets if self.reported.get(layer) is False)
        self._not_known_routed = tuple(layer for layer in self.targets if not self.reported.get(layer, False))

    def unrouted(self) -> tuple[int, ...]:
        return self._unrouted

    def not_known_routed(self) -> tuple[int, ...]:
        return self._not_known_routed
