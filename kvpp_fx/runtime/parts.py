"""What every forward of a runtime works with: each target layer's route, and the runtime's parts.

Both are built once per runtime (`KVPPRuntime.__init__`) and handed to each `Forward`, which reads
nothing else of the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvpp_fx.runtime.active_blocks import Shape
from kvpp_fx.schedule import LayerSchedule


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
    whole: tuple[torch.Tensor, ...] = ()  # a whole-layer broadcast's payload: (view,)


@dataclass(frozen=True)
class ForwardParts:
    """What every forward of a runtime works with, built once by the runtime and handed to each."""

    schedule: LayerSchedule
    routes: tuple[LayerRoute, ...]
    storage: Any  # CacheStorage
    api: Any  # DeviceAPI
    transport: Any  # BroadcastTransport, None for a group of one
    agreement: Any  # Agreement, None for a group of one
    health: Any  # Health
    stats: Any  # TransferStats
    timeline: Any  # Timeline or None
    overlap: bool
    group: Any
    group_size: int
    attention: Any  # AttentionShape or None
    exchange_group: Any  # owner mode's gathers and scatters: the same ranks as `group`, its own communicator
    checks: Any  # PendingChecks: a device's checks of earlier forwards, read later


def layer_route(plan: Any, storage: Any, group: Any, rank: int, layer: int, position: int) -> LayerRoute:
    """`layer`'s route on `rank`: its view, its slot, its owner, its sizes."""
    view = storage.byte_view(layer)
    block_views = tuple(storage.block_views(layer))
    slot, owned = plan.slot(layer), plan.owners[layer] == rank
    # The owner packs into its own slot for the layer, which it never reads for a layer it owns.
    pack_views = tuple(storage.slot_block_views(slot, layer)) if owned and storage.scratch else ()
    src = dist.get_global_rank(group, plan.owners[layer]) if group is not None else 0
    nbytes = storage.num_blocks * plan.bundle_bytes_per_block(layer)  # a whole layer
    return LayerRoute(layer, position, slot, owned, src, view, nbytes, block_views,
                      tuple(v.shape[1] for v in block_views), pack_views, (view,))


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
