"""The step's attention metadata as non-owned layers read their packed scratch slots.

When a forward packs blocks (`KVPPRuntime.packed_tables`), a rank that reads layer L from its scratch slot holds
there only the step's listed blocks, in list order, at the front. vLLM's attention reads its block ids
from the forward context, per layer name: ``attn_metadata[name]`` (the MLA decode and prefill block tables)
and ``slot_mapping[name]`` (where the cache write puts each new token). So, once per forward, before the
model runs, every non-owned target layer gets its own metadata object: a copy whose block tables and
slot mapping are remapped by the forward's `PackedTables`, once per metadata object: the non-owned layers
of one metadata object share the copy. Owned and draft layers keep vLLM's objects, which index their
persistent caches.

Invariants:
- Nothing vLLM owns is mutated: the runner's block table, slot buffer and metadata objects are read by
  the drafter after the forward. The forward context gets new dicts; the copies hold new tensors.
- A backend's per-step attributes on vLLM's decode and prefill metadata (set by its builder, outside the
  dataclass fields) go to the copies: those derived from the block table (AMX_MLA's token-level table)
  are derived again from the remapped one, the others are copied. An attribute this module does not
  know raises `PackedMetadataError`.
- A metadata object of a kind this module does not know raises `PackedMetadataError` before attention
  runs. A block id of a decode row that the packed list does not hold raises `UnlistedBlockError`
  (`PackedTables.check_reads`): on CPU before attention runs (vLLM's CPU decode kernel does not
  bound-check block ids), on a device from the forward's checks one step later, with no host wait. The
  CPU kernel also reads every row's entries up to the batch's longest row and masks them, so the rows'
  padding (stale ids) points at a position the slot holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvpp_fx.runtime.active_blocks import BLOCK_TABLE, SLOT_MAPPING
from kvpp_fx.runtime.packed_tables import PackedTables
from kvpp_fx.runtime.runtime import KVPPRuntime


class PackedMetadataError(RuntimeError):
    """A non-owned layer's metadata cannot be remapped to its packed scratch slot."""


# vLLM 0.32's AMX_MLA builder (`AMXMLAMetadataBuilder.build`) sets these on its decode and prefill
# metadata: a token-level block table, read by its kernels instead of ``block_table``...
TOKEN_TABLES = ("req_to_token",)
# ...and attributes that hold no block id.
BLOCK_FREE_ATTRIBUTES = ("seq_lens_i64", "req_pool_indices", "num_kv_splits", "cpu_seq_lens", "extend_seq_lens",
                         "extend_start_loc", "max_len_extend")


@dataclass(frozen=True)
class Remap:
    """What one forward's remap of vLLM's metadata reads: its packed tables, the layers this rank reads from
    a slot, whether its decode rows read here (none go to the owner), the block size."""

    tables: PackedTables
    slot_layers: frozenset[int]
    checks_decode: bool
    block_size: int


def rebind(forward_context: Any, tables: PackedTables, runtime: KVPPRuntime, layer_index: Mapping[str, int]) -> int:
    """Give each non-owned target layer in `forward_context` metadata over its packed slot, remapped once
    per metadata object by the forward's `tables`; returns how many layers got it."""
    plan = runtime.plan
    remap = Remap(tables, frozenset(layer for layer in plan.target_layers if plan.owners[layer] != runtime.rank),
                  not runtime.path.owner_tokens, plan.spec.block_size)
    metadata = forward_context.attn_metadata
    if isinstance(metadata, list):  # micro-batches (DBO): one dict per micro-batch
        remapped = [_rebind_dict(part, remap, layer_index) for part in metadata]
        forward_context.attn_metadata = [part for part, _ in remapped]
        count = sum(n for _, n in remapped)
    else:
        forward_context.attn_metadata, count = _rebind_dict(metadata, remap, layer_index)
    slots = getattr(forward_context, "slot_mapping", None)
    if isinstance(slots, dict) and slots:
        rebound, copies = dict(slots), {}
        for name, slot in slots.items():
            if layer_index.get(name) in remap.slot_layers and isinstance(slot, torch.Tensor):
                if id(slot) not in copies:
                    (copies[id(slot)],) = tables.remap([slot], [SLOT_MAPPING], request_rows=False)
                rebound[name] = copies[id(slot)]
        forward_context.slot_mapping = rebound
    return count


def _rebind_dict(metadata: Any, remap: Remap, layer_index: Mapping[str, int]) -> tuple[Any, int]:
    if not isinstance(metadata, dict):
        return metadata, 0
    out, copies, count = dict(metadata), {}, 0
    for name, value in metadata.items():
        index = layer_index.get(name)
        if value is None or index not in remap.slot_layers:
            continue
        key = id(value)
        if key not in copies:
            copies[key] = remap_metadata(value, remap, index)
        out[name] = copies[key]
        count += 1
    return out, count


def remap_metadata(metadata: Any, remap: Remap, index: int) -> Any:
    """A copy of one MLA metadata object whose block tables and slot mapping read the packed slot (`index`:
    the first layer that reads it, which errors name)."""
    tables = remap.tables

    def remapped(table: torch.Tensor, kind: str, in_range: bool = False) -> torch.Tensor:
        (out,) = tables.remap([table], [kind], request_rows=False, unlisted_in_range=in_range)
        return out

    if not dataclasses.is_dataclass(metadata) or not hasattr(metadata, "decode") or not hasattr(metadata, "prefill"):
        raise PackedMetadataError(
            f"layer {index}: KVPP cannot remap attention metadata of type {type(metadata).__name__} to a packed "
            "scratch slot (it remaps MLA metadata: decode and prefill block tables, slot mapping).")
    others = [f.name for f in dataclasses.fields(metadata)
              if "block_table" in f.name and isinstance(getattr(metadata, f.name), torch.Tensor)]
    if others:  # block ids this module does not remap (sparse MLA's top-level table, for one)
        raise PackedMetadataError(
            f"layer {index}: {type(metadata).__name__} holds block ids in {others}, which KVPP does not remap to "
            "a packed scratch slot.")
    changes: dict[str, Any] = {}
    decode = metadata.decode
    if decode is not None:
        # vLLM's CPU decode kernel reads every row up to the batch's longest and masks the rest, so a
        # row's padding (stale ids of earlier requests) must stay inside the slot; the entries the rows
        # use are checked below.
        table = remapped(decode.block_table, BLOCK_TABLE, in_range=True)
        if remap.checks_decode:  # decode rows sent to the owner read nothing here
            tables.check_reads(index, decode.block_table, decode.seq_lens)
        changes["decode"] = _with_backend_attributes(decode, dataclasses.replace(decode, block_table=table),
                                                     remap.block_size, index)
    prefill = metadata.prefill
    if prefill is not None:
        copy = dataclasses.replace(prefill, block_table=remapped(prefill.block_table, BLOCK_TABLE))
        changes["prefill"] = _with_backend_attributes(prefill, copy, remap.block_size, index)
    slot_mapping = getattr(metadata, "slot_mapping", None)
    if isinstance(slot_mapping, torch.Tensor):
        changes["slot_mapping"] = remapped(slot_mapping, SLOT_MAPPING)
    return dataclasses.replace(metadata, **changes)


def _with_backend_attributes(original: Any, copy: Any, block_size: int, index: int) -> Any:
    """`copy` (remapped fields) with the attributes a backend's builder set on `original` outside its fields.
    A field besides the block table that holds block ids (a backend's own page table, as ROCm AITER's
    ``paged_kv_indices``) is refused: its kernel would read the slot at pool positions."""
    own_tables = [f.name for f in dataclasses.fields(original)
                  if f.name != "block_table" and ("block" in f.name or "kv_indices" in f.name)
                  and isinstance(getattr(original, f.name), torch.Tensor)]
    if own_tables:
        raise PackedMetadataError(
            f"layer {index}: {type(original).__name__} holds block ids in {own_tables} besides its block_table, "
            "which KVPP does not remap to a packed scratch slot.")
    fields = {f.name for f in dataclasses.fields(original)}
    for name, value in vars(original).items():
        if name in fields:
            continue
        if name in TOKEN_TABLES:
            from vllm.v1.attention.backends.mla.amx_mla import _expand_block_table  # what its builder derives

            value = _expand_block_table(copy.block_table, block_size).to(value.dtype)
        elif name not in BLOCK_FREE_ATTRIBUTES:
            raise PackedMetadataError(
                f"layer {index}: {type(original).__name__} carries {name!r}, set by its backend outside its fields, "
                "which KVPP does not know how to remap to a packed scratch slot.")
        setattr(copy, name, value)
    return copy
