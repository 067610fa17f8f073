"""Active blocks: one forward's set of block ids with history, and what each layer's broadcast does with it.

``runtime.forward(has_history, blocks=ids)`` names the blocks the step reads that hold tokens computed
before it. Per forward, once (`ActiveBlocks.prepare`): the ids are validated (`InvalidBlocksError`),
sorted, digested for the agreement and put on the device as one int64 index, and a staging view is cut
for each bundle shape; no layer allocates memory. Per layer, on the transfer stream: the owner packs
the ids, then the listed blocks of every component, component-major, into staging (`pack`); one
broadcast carries them; every receiver compares the ids that arrived with its own and scatters each
component into the layer's slot at the same ids (`unpack`). The comparison catches a broadcast that
paired with another forward's: on CPU after each layer (`layer_arrived`), on a device once, when the
forward ends (`all_arrived`), as `DeviceAPI.immediate_checks` says.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvpp_fx.cache.allocate import CacheStorage
from kvpp_fx.cache.placement import BLOCK_ID_BYTES
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import InvalidBlocksError

Shape = tuple[int, ...]  # the bytes per block of each component of a bundle, in layout order


@dataclass
class _Staging:
    """The staging buffer cut for one bundle shape: the whole payload, the ids in front, each component."""

    payload: torch.Tensor
    header: torch.Tensor
    parts: tuple[torch.Tensor, ...]


@dataclass
class ActiveBlocks:
    ids: torch.Tensor
    count: int
    digest: int  # of the sorted ids, for the forward's agreement
    staging: dict[Shape, _Staging]
    arrived: torch.Tensor  # receivers: whether every list of ids received so far equals their own
    _equal: torch.Tensor  # scratch for one layer's comparison, so no layer allocates
    _layer_arrived: torch.Tensor

    @classmethod
    def prepare(cls, blocks: Any, storage: CacheStorage, shapes: Iterable[Shape],
                crossover: float) -> ActiveBlocks | None:
        """Validate the set and build its device index and staging views; None means whole layers (the
        set is beyond the staging capacity or the crossover fraction of the pool)."""
        num_blocks = storage.num_blocks
        try:
            ids = sorted({int(b) for b in (blocks.tolist() if isinstance(blocks, torch.Tensor) else blocks)})
        except (TypeError, ValueError):
            raise InvalidBlocksError(f"blocks must be an iterable of block ids, got {blocks!r}.") from None
        if ids and (ids[0] < 0 or ids[-1] >= num_blocks):
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise InvalidBlocksError(f"block id {bad} is outside the pool of {num_blocks} blocks.")
        count = len(ids)
        if not storage.plan.uses_active_blocks(count, num_blocks, crossover):
            return None
        staging = {shape: _cut_staging(storage.staging, count, shape) for shape in set(shapes)}
        digest = int.from_bytes(hashlib.blake2b(repr(ids).encode(), digest_size=8).digest(), "little") >> 2
        device = storage.device
        return cls(torch.tensor(ids, dtype=torch.int64, device=device), count, digest, staging,
                   torch.ones((), dtype=torch.bool, device=device), torch.empty(count, dtype=torch.bool, device=device),
                   torch.empty((), dtype=torch.bool, device=device))

    def payload(self, shape: Shape) -> torch.Tensor:
        """What one layer of this bundle shape broadcasts: the ids and the listed blocks."""
        return self.staging[shape].payload

    def pack(self, api: DeviceAPI, sources: tuple[torch.Tensor, ...], shape: Shape) -> None:
        """The owner, on the transfer stream: the ids, then each component's listed blocks, into staging."""
        staging = self.staging[shape]
        staging.header.copy_(self.ids)
        for source, part in zip(sources, staging.parts):
            api.gather_blocks(source, self.ids, part)

    def unpack(self, api: DeviceAPI, dests: tuple[torch.Tensor, ...], shape: Shape) -> None:
        """A receiver, on the transfer stream: check the ids that arrived, scatter each component."""
        staging = self.staging[shape]
        torch.eq(staging.header, self.ids, out=self._equal)
        torch.all(self._equal, out=self._layer_arrived)
        self.arrived.logical_and_(self._layer_arrived)
        for dest, part in zip(dests, staging.parts):
            api.scatter_blocks(dest, self.ids, part)

    def layer_arrived(self) -> bool:
        """Whether the last unpacked layer's ids were this forward's (reads the device: CPU only)."""
        return bool(self._layer_arrived)

    def all_arrived(self) -> bool:
        """Whether every unpacked layer's ids were this forward's (one host read, at forward end)."""
        return bool(self.arrived.item())


def _cut_staging(staging: torch.Tensor, count: int, shape: Shape) -> _Staging:
    header = staging[: count * BLOCK_ID_BYTES].view(torch.int64)
    offset, parts = count * BLOCK_ID_BYTES, []
    for width in shape:
        parts.append(staging[offset: offset + count * width].view(count, width))
        offset += count * width
    return _Staging(staging[:offset], header, tuple(parts))
