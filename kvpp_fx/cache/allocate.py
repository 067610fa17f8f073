"""Physical cache allocation for one rank of a KVPP group.

Invariants:
- The rank allocates exactly ``plan.buffers(rank)``: one zeroed, 2 MiB-padded buffer per owned target
  bundle and per local draft cache, plus ``depth`` scratch buffers of ``slot_blocks`` blocks (S) of the
  largest target bundle, each with one int64 id per block in front. Nothing else holds cache bytes, so
  ``allocated_bytes == plan.bytes_for(num_blocks, rank)``.
- Every layer has one contiguous byte view over its bundle: its persistent buffer (``num_blocks``
  blocks) where the rank keeps it, the bundle region of ``scratch[plan.slot(layer)]`` (S blocks)
  otherwise. Layers that share a slot share bytes; no other layers do.
- Every component has a typed view ``[blocks, block_size, *per_token]`` over the byte view, at the
  component-major offset of ``plan.layout``, and a block view ``[blocks, bytes_per_block]`` (uint8) over
  the same bytes, which the owner gathers from and packs into whatever the dtype.
- A slot's ids region (padded to 4 KiB, `ids_region_bytes`) ends where its bundle region starts, so the
  ids of n packed blocks, at the region's end, and the first component's n blocks are one contiguous
  payload (`packed_payloads`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpp_fx.cache.placement import BLOCK_ID_BYTES, KVPPPlan, ids_region_bytes

TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


@dataclass
class CacheStorage:
    """The cache bytes of one rank and the views over them."""

    plan: KVPPPlan
    rank: int
    num_blocks: int
    device: torch.device
    persistent: dict[int, torch.Tensor] = field(repr=False)  # layer -> owned bundle or local draft
    scratch: tuple[torch.Tensor, ...] = field(repr=False)
    byte_views: dict[int, torch.Tensor] = field(repr=False)
    typed: dict[int, dict[str, torch.Tensor]] = field(repr=False)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self.persistent.values()) + sum(b.numel() for b in self.scratch)

    @property
    def slot_blocks(self) -> int:
        """S: the blocks of one scratch slot (the pool's with whole-layer slots)."""
        return self.plan.slot_blocks(self.num_blocks)

    def blocks_of(self, layer: int) -> int:
        """The blocks of the layer's view on this rank: the pool where it is local, S elsewhere."""
        return self.num_blocks if self.plan.is_local(layer, self.rank) else self.slot_blocks

    def block_views(self, layer: int) -> list[torch.Tensor]:
        """Per component, in layout order: ``[blocks, bytes_per_block]`` uint8 over the layer's bytes."""
        view, blocks = self.byte_view(layer), self.blocks_of(layer)
        return [view[where.offset: where.offset + where.size].view(blocks, -1)
                for where in self.plan.layout(layer, blocks)]

    def slot_block_views(self, slot: int, layer: int) -> list[torch.Tensor]:
        """Per component of `layer`'s bundle: ``[S, bytes_per_block]`` over scratch slot `slot`'s bundle
        region, where the owner of a layer packs the blocks it broadcasts."""
        region = self._slot_region(slot)
        return [region[where.offset: where.offset + where.size].view(self.slot_blocks, -1)
                for where in self.plan.layout(layer, self.slot_blocks)]

    def packed_payloads(self, slot: int, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                          tuple[torch.Tensor, ...]]:
        """One broadcast's tensors for `count` packed blocks of `layer` in slot `slot`: the ids
        (``[count]`` int64) and, per component, the bytes that travel (the first joined with the ids)."""
        slot_bytes, ids_bytes = self.scratch[slot], ids_region_bytes(self.slot_blocks)
        ids = slot_bytes[ids_bytes - count * BLOCK_ID_BYTES: ids_bytes].view(torch.int64)
        parts = tuple(v[:count].reshape(-1) for v in self.slot_block_views(slot, layer))
        if not parts:
            return ids, ids, ()
        first = slot_bytes[ids_bytes - count * BLOCK_ID_BYTES: ids_bytes + parts[0].numel()]
        return ids, first, parts[1:]

    def _slot_region(self, slot: int) -> torch.Tensor:
        start = ids_region_bytes(self.slot_blocks)
        return self.scratch[slot][start: start + self.slot_blocks * self.plan.largest_target_bytes_per_block]

    @property
    def persistent_layers(self) -> tuple[int, ...]:
        """Layers whose bytes this rank keeps across steps (read from the buffers, not the plan)."""
        return tuple(sorted(self.persistent))

    def byte_view(self, layer: int) -> torch.Tensor:
        try:
            return self.byte_views[layer]
        except KeyError:
            raise KeyError(f"layer {layer} has no cache on rank {self.rank}.") from None

    def typed_views(self, layer: int) -> dict[str, torch.Tensor]:
        self.byte_view(layer)
        return self.typed[layer]

    def handles(self, layer: int) -> dict[str, torch.Tensor]:
        """Stand-ins for the graph's cache inputs: the typed views' shapes and dtypes, no bytes.

        A compiled model takes these where a replicated run takes its caches; ``kvpp.wait`` swaps them
        for the real views. Each is a zero-stride expansion of one element with no cache bytes
        behind it; cache ops refuse such a tensor, so only a rebound graph can use the cache.
        """
        return {name: torch.empty((), dtype=view.dtype, device=view.device).expand(view.shape)
                for name, view in self.typed_views(layer).items()}


def allocate_cache(plan: KVPPPlan, rank: int, num_blocks: int,
                   device: torch.device | str = "cpu") -> CacheStorage:
    """Allocate `rank`'s cache for `num_blocks` blocks as the plan lays it out."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}.")
    device = torch.device(device)
    plan.check_pool(num_blocks)
    persistent: dict[int, torch.Tensor] = {}
    scratch: list[torch.Tensor] = []
    for buf in plan.buffers(rank):
        tensor = torch.zeros(buf.nbytes(num_blocks), dtype=torch.uint8, device=device)
        if buf.kind == "scratch":
            scratch.append(tensor)
        else:
            persistent[buf.key] = tensor

    byte_views: dict[int, torch.Tensor] = {}
    typed: dict[int, dict[str, torch.Tensor]] = {}
    slot_blocks = plan.slot_blocks(num_blocks)
    for layer in plan.layers:
        if plan.is_local(layer, rank):
            backing, start, blocks = persistent[layer], 0, num_blocks
        else:
            backing, start, blocks = scratch[plan.slot(layer)], ids_region_bytes(slot_blocks), slot_blocks
        view = backing[start: start + blocks * plan.bundle_bytes_per_block(layer)]
        byte_views[layer] = view
        typed[layer] = _typed_views(plan, layer, view, blocks)
    return CacheStorage(plan, rank, num_blocks, device, persistent, tuple(scratch), byte_views, typed)


def _typed_views(plan: KVPPPlan, layer: int, view: torch.Tensor, num_blocks: int) -> dict[str, torch.Tensor]:
    spec = plan.spec.layer(layer)
    out = {}
    for comp, where in zip(spec.components, plan.layout(layer, num_blocks)):
        raw = view[where.offset: where.offset + where.size]
        out[comp.name] = raw.view(TORCH_DTYPES[comp.dtype]).view(
            num_blocks, plan.spec.block_size, *comp.per_token)
    return out
