"""Packed blocks: one forward's list of the blocks its broadcast rows touch, packed into the front of each
scratch slot, and the remapped tables attention reads them through.

``runtime.forward(has_history, blocks=ids, written=ids)`` names the blocks the step reads that hold
tokens computed before it (``blocks``, which travel) and the blocks it writes that hold none
(``written``, which only take a position). Per forward, once (`PackedBlocks.prepare`): the ids are
validated (`InvalidBlocksError`), sorted, checked against the slot's S blocks (`ScratchOverflowError`),
digested for the agreement (over the int64 bytes), uploaded without the host waiting (`DeviceAPI.upload`)
and turned into one device lookup ``positions[block id]``: the history
blocks take positions ``0..n-1``, the written ones ``n..m-1``, every other id the out-of-range value S.
Per layer, on the transfer stream: the owner gathers the history blocks of every component out of its
persistent cache into the front of its own slot for the layer, the ids at the end of the slot's ids
region (`pack`); one broadcast per component carries them, the ids with the first; every receiver
receives into the same place of its own slot and compares the ids with its own (`arrived`); nothing is
scattered. The comparison catches a broadcast that paired with another forward's: on CPU after each
layer (`layer_arrived`), on a device in one flag per forward (`arrived`), read later (`PendingChecks`).

Attention on a non-owner reads the slot through remapped tables (`remap`): a block table's entries
become positions (negative entries stay, an unlisted block becomes S, which no slot holds, so a read of
it fails instead of returning another block's bytes), and a slot mapping's slots move with their block
(an unlisted block's write is dropped: nothing on this rank reads it in this forward, and the next one
receives it from the owner).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvpp_fx.cache.allocate import CacheStorage
from kvpp_fx.cache.block_ids import BlockIds, difference
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import InvalidBlocksError, ScratchOverflowError, UnlistedBlockError

Shape = tuple[int, ...]  # the bytes per block of each component of a bundle, in layout order
BLOCK_TABLE, SLOT_MAPPING = "block_table", "slot_mapping"
TABLE_KINDS = (BLOCK_TABLE, SLOT_MAPPING)


def block_ids(blocks: Any, what: str, num_blocks: int) -> BlockIds:
    """`blocks` (a `BlockIds`, an array, a host tensor or any iterable of ints) as a checked `BlockIds`."""
    try:
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.numpy(force=True)
        ids = BlockIds.of(blocks)
    except (TypeError, ValueError):
        raise InvalidBlocksError(f"{what} must be an iterable of block ids, got {blocks!r}.") from None
    if ids and (ids[0] < 0 or ids[-1] >= num_blocks):
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise InvalidBlocksError(f"{what}: block id {bad} is outside the pool of {num_blocks} blocks.")
    return ids


def digest(history: BlockIds, fresh: BlockIds) -> int:
    """One int64 (62 bits) over both sorted lists' bytes, for the forward's agreement."""
    hasher = hashlib.blake2b(digest_size=8)
    hasher.update(len(history).to_bytes(8, "little"))
    hasher.update(history.array.tobytes())
    hasher.update(fresh.array.tobytes())
    return int.from_bytes(hasher.digest(), "little") >> 2


@dataclass
class PackedBlocks:
    ids: torch.Tensor  # the history blocks, sorted (what travels)
    count: int
    written: int  # blocks that only take a position
    digest: int  # of both lists, for the forward's agreement
    positions: torch.Tensor  # [num_blocks] int64
    slot_blocks: int
    block_size: int
    arrived: torch.Tensor  # receivers: whether every list of ids received so far equals their own
    _equal: torch.Tensor  # scratch for one layer's comparison, so no layer allocates
    _layer_arrived: torch.Tensor
    unlisted_reads: torch.Tensor  # a device's `check_reads`: whether any row read an unlisted block
    _payloads: dict[tuple[int, int], tuple] = field(default_factory=dict)
    _remapped: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def prepare(cls, blocks: Any, written: Any, storage: CacheStorage, api: DeviceAPI) -> PackedBlocks:
        """Validate both lists and build the forward's lookup; raises before anything moves."""
        num_blocks, slot_blocks = storage.num_blocks, storage.slot_blocks
        history = block_ids(blocks if blocks is not None else (), "blocks", num_blocks)
        fresh = difference(block_ids(written if written is not None else (), "written", num_blocks), history)
        if len(history) + len(fresh) > slot_blocks:
            raise ScratchOverflowError(
                f"the step's broadcast rows touch {len(history) + len(fresh)} blocks ({len(history)} with history, "
                f"{len(fresh)} written), more than a scratch slot's {slot_blocks}; route rows to their owners "
                "(forward(requests=...)) or give the slots more blocks (max_model_len, scratch_blocks).")
        device = storage.device
        listed = api.upload(np.concatenate((history.array, fresh.array)))
        positions = torch.full((num_blocks,), slot_blocks, dtype=torch.int64, device=device)
        positions[listed] = torch.arange(listed.shape[0], dtype=torch.int64, device=device)
        count = len(history)
        return cls(listed[:count], count, len(fresh), digest(history, fresh), positions, slot_blocks,
                   storage.plan.spec.block_size,
                   torch.ones((), dtype=torch.bool, device=device), torch.empty(count, dtype=torch.bool, device=device),
                   torch.empty((), dtype=torch.bool, device=device), torch.zeros((), dtype=torch.bool, device=device))

    # --- per layer, on the transfer stream ---------------------------------------------------------

    def payloads(self, storage: CacheStorage, slot: int, layer: int) -> tuple:
        """(ids, tensors to broadcast) of `layer` in `slot`, cut once per forward."""
        key = (slot, layer)
        if key not in self._payloads:
            ids, first, rest = storage.packed_payloads(slot, layer, self.count)
            self._payloads[key] = (ids, (first, *rest))
        return self._payloads[key]

    def pack(self, api: DeviceAPI, sources: tuple[torch.Tensor, ...], dests: tuple[torch.Tensor, ...],
             ids_out: torch.Tensor) -> None:
        """The owner: the ids, then each component's listed blocks, into the front of its own slot."""
        ids_out.copy_(self.ids)
        for source, dest in zip(sources, dests):
            api.gather_blocks(source, self.ids, dest[: self.count])

    def check(self, received: torch.Tensor) -> None:
        """A receiver: whether the ids that arrived are this forward's."""
        torch.eq(received, self.ids, out=self._equal)
        torch.all(self._equal, out=self._layer_arrived)
        self.arrived.logical_and_(self._layer_arrived)

    def layer_arrived(self) -> bool:
        """Whether the last received layer's ids were this forward's (reads the device: CPU only)."""
        return bool(self._layer_arrived)

    # --- the tables attention reads ----------------------------------------------------------------

    def remap(self, api: DeviceAPI, table: torch.Tensor, kind: str, owner_rows: tuple[int, ...] = (),
              unlisted_in_range: bool = False) -> torch.Tensor:
        """`table` as a non-owner's attention reads the packed slot; one tensor per input per forward.

        ``owner_rows``: in a hybrid forward, the block-table rows of the requests whose attention runs
        on the owner. This rank's ops may still read them (an owner-local op runs every row), but never
        use what they read there: they point at position 0, which every slot holds.
        ``unlisted_in_range``: unlisted entries point at position 0 instead of S, for kernels that read
        a row's padding entries and mask what they read (vLLM's CPU decode kernel); the caller then
        checks the entries its rows do use (`packed_metadata`)."""
        key = (kind, id(table), owner_rows, unlisted_in_range)
        cached = self._remapped.get(key)
        if cached is not None and cached[0] is table:
            return cached[1]
        if kind == BLOCK_TABLE:
            out = api.remap_block_table(table, self.positions)
            if unlisted_in_range:
                out = out.masked_fill(out == self.slot_blocks, 0)
            if owner_rows and table.dim() == 2:
                out.index_fill_(0, api.upload(np.asarray(owner_rows, dtype=np.int64)), 0)
        elif kind == SLOT_MAPPING:
            out = api.remap_slot_mapping(table, self.positions, self.block_size, self.slot_blocks)
        else:
            raise ValueError(f"a table operand is one of {TABLE_KINDS}, got {kind!r}.")
        self._remapped[key] = (table, out)
        return out

    def check_reads(self, api: DeviceAPI, layer: int, table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Every entry a row of the block table `table` reads (its first ``ceil(seq_len / block)``) is a
        listed block. Where checks are immediate (CPU) `UnlistedBlockError` is raised here; on a device the
        answer joins `unlisted_reads`, which the forward's checks read later, and the host never waits."""
        if table.numel() == 0:
            return
        positions = self.remap(api, table, BLOCK_TABLE)  # unlisted ids and negative entries leave the slot
        reads = (seq_lens.to(torch.int64) + self.block_size - 1) // self.block_size
        read = torch.arange(table.shape[1], device=table.device)[None, :] < reads[:, None].to(table.device)
        outside = read & ((positions < 0) | (positions >= self.slot_blocks))
        if not api.immediate_checks:
            self.unlisted_reads.logical_or_(outside.any())
            return
        if bool(outside.any()):
            row, column = (int(v) for v in outside.nonzero()[0])
            raise UnlistedBlockError(
                f"layer {layer}: row {row} reads block-table entry {column} (block {int(table[row, column])}), "
                f"which the forward's packed list does not hold (a slot of {self.slot_blocks} blocks); the "
                "step's blocks= and written= miss a block it reads.")
