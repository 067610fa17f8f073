"""`PackedTables`: one forward's block tables and slot mappings as a non-owner reads its packed scratch slots.

A packing forward (`ChosenPath.pack`) builds one, in `Forward.begin`, over its packed blocks: the remap of
a table depends on the forward's block list only, never on the layer, so a caller that holds a step's
tables before any layer runs (vLLM's metadata) remaps them once per forward and hands the copies to every
layer this rank reads from a slot; a graph, whose tables are each layer's inputs, remaps at each non-owned
layer's wait (`LayerTurn.tables`). An owned layer reads its persistent cache and takes the tables as they
are: its turn has no `PackedTables`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvpp_fx.cache.cost import OWNER

if TYPE_CHECKING:
    from kvpp_fx.runtime.active_blocks import PackedBlocks
    from kvpp_fx.runtime.device import DeviceAPI


class PackedTables:
    """A packing forward's remap of block tables and slot mappings to the front of its scratch slots."""

    __slots__ = ("active", "api", "owner_rows")

    def __init__(self, active: PackedBlocks, api: DeviceAPI, request_paths: Sequence[str] | None) -> None:
        self.active = active
        self.api = api
        # a hybrid forward's owner requests: their block-table rows point where every slot holds a block
        self.owner_rows = tuple(k for k, mode in enumerate(request_paths or ()) if mode == OWNER)

    def remap(self, tables: Sequence[torch.Tensor], kinds: Sequence[str], *, request_rows: bool = True,
              unlisted_in_range: bool = False) -> list[torch.Tensor]:
        """`tables` of `kinds` ("block_table", "slot_mapping") as a non-owner reads the packed slot
        (`PackedBlocks.remap`). ``request_rows``: a block table's rows are the forward's requests in order
        (as ``requests=`` names them, the graph's contract), so in a hybrid forward the owner requests' rows,
        which this rank reads but never uses, point at a position every slot holds. ``unlisted_in_range``: an
        entry of a block the forward did not list points at position 0 rather than out of the slot, for
        kernels that read padding entries; the caller checks the entries its rows use (`check_reads`)."""
        if len(tables) != len(kinds):
            raise ValueError(f"{len(tables)} tables but {len(kinds)} table kinds.")
        owner_rows = self.owner_rows if request_rows else ()
        return [self.active.remap(self.api, table, kind, owner_rows, unlisted_in_range)
                for table, kind in zip(tables, kinds)]

    def check_reads(self, layer: int, table: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Every block the rows of `table` read (the first ``ceil(seq_len / block)`` entries of each; the
        table as given, not remapped) is one the forward listed, else `UnlistedBlockError` naming `layer`:
        raised here on CPU, on a device from the forward's checks one step later, without the host waiting."""
        self.active.check_reads(self.api, layer, table, seq_lens)
