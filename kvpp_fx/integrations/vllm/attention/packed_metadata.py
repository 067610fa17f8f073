"""The step's attention metadata as non-owned layers read their packed scratch slots.

When a forward packs blocks (`KVPPRuntime.packed`), a rank that reads layer L from its scratch slot holds
there only the step's listed blocks, in list order, at the front. vLLM's attention reads its block ids
from the forward context, per layer name: ``attn_metadata[name]`` (the MLA decode and prefill block tables)
and ``slot_mapping[name]`` (where the cache write puts each new token). So, once per forward, before the
model runs, every non-owned target layer gets its own metadata object: a copy whose block tables and
slot mapping are remapped by the runtime (`KVPPRuntime.tables`), shared by the non-owned layers of one
metadata object. Owned and draft layers keep vLLM's objects, which index their persistent caches.

Invariants:
- Nothing vLLM owns is mutated: the runner's block table, slot buffer and metadata objects are read by
  the drafter after the forward. The forward context gets new dicts; the copies hold new tensors.
- A backend's per-step attributes on vLLM's decode and prefill metadata (set by its builder, outside the
  dataclass fields) go to the copies: those derived from the block table (AMX_MLA's token-level table)
  are derived again from the remapped one, the others are copied. An attribute this module does not
  know raises `PackedMetadataError`.
- A metadata object of a kind this module does not know raises `PackedMetadataError` before attention
  runs. A block id of a decode row that the packed list does not hold raises `UnlistedBlockError`
  (`KVPPRuntime.check_reads`): on CPU before attention runs (vLLM's CPU decode kernel does not
  bound-check block ids), on a device from the forward's checks one step later, with no host wait. The
  CPU kernel also reads every row's entries up to the batch's longest row and masks them, so the rows'
  padding (stale ids) points at a position the slot holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from kvpp_fx.runtime.active_blocks import BLOCK_TABLE, SLOT_MAPPING
from kvpp_fx.runtime.runtime import KVPPRuntime


class PackedMetadataError(RuntimeError):
    """A non-owned layer's metadata cannot be remapped to its packed scratch slot."""


# vLLM 0.32's AMX_MLA builder (`AMXMLAMetadataBuilder.build`) sets these on its decode and prefill
# metadata: a token-level block table, read by its kernels instead of ``block_table``...
TOKEN_TABLES = ("req_to_token",)
# ...and attributes that hold no block id.
BLOCK_FREE_ATTRIBUTES = ("seq_lens_i64", "req_pool_indices", "num_kv_splits", "cpu_seq_lens", "extend_seq_lens",
                         "extend_start_loc", "max_len_extend")


def rebind(forward_context: Any, runtime: KVPPRuntime, layer_index: Mapping[str, int]) -> int:
    """Give each non-owned target layer in `forward_context` metadata over its packed slot; returns how
    many layers got it."""
    metadata = forward_context.attn_metadata
    if isinstance(metadata, list):  # micro-batches (DBO): one dict per micro-batch
        remapped = [_rebind_dict(part, runtime, layer_index) for part in metadata]
        forward_context.attn_metadata = [part for part, _ in remapped]
        count = sum(n for _, n in remapped)
    else:
        forward_context.attn_metadata, count = _rebind_dict(metadata, runtime, layer_index)
    slots = getattr(forward_context, "slot_mapping", None)
    if isinstance(slots, dict) and slots:
        rebound = dict(slots)
        for name, slot in slots.items():
            index = layer_index.get(name)
            if index is not None and _reads_slot(runtime, index) and isinstance(slot, torch.Tensor):
                (rebound[name],) = runtime.tables(index, [slot], [SLOT_MAPPING], request_rows=False)
        forward_context.slot_mapping = rebound
    return count


def _reads_slot(runtime: KVPPRuntime, index: int) -> bool:
    return index in runtime.plan.owners and not runtime.owns(index)


def _rebind_dict(metadata: Any, runtime: KVPPRuntime, layer_index: Mapping[str, int]) -> tuple[Any, int]:
    if not isinstance(metadata, dict):
        return metadata, 0
    out, copies, count = dict(metadata), {}, 0
    for name, value in metadata.items():
        index = layer_index.get(name)
        if value is None or index is None or not _reads_slot(runtime, index):
            continue
        key = id(value)
        if key not in copies:
            copies[key] = remap_metadata(value, runtime, index)
        out[name] = copies[key]
        count += 1
    return out, count


def remap_metadata(metadata: Any, runtime: KVPPRuntime, index: int) -> Any:
    """A copy of one MLA metadata object whose block tables and slot mapping read the packed slot."""
    def remap(table: torch.Tensor, kind: str, in_range: bool = False) -> torch.Tensor:
        (out,) = runtime.tables(index, [table], [kind], request_rows=False, unlisted_in_range=in_range)
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
        table = remap(decode.block_table, BLOCK_TABLE, in_range=True)
        if not runtime.owner_tokens:  # decode rows sent to the owner read nothing here
            runtime.check_reads(index, decode.block_table, decode.seq_lens)
        changes["decode"] = _with_backend_attributes(decode, dataclasses.replace(decode, block_table=table), runtime,
                                                     index)
    prefill = metadata.prefill
    if prefill is not None:
        remapped = dataclasses.replace(prefill, block_table=remap(prefill.block_table, BLOCK_TABLE))
        changes["prefill"] = _with_backend_attributes(prefill, remapped, runtime, index)
    slot_mapping = getattr(metadata, "slot_mapping", None)
    if isinstance(slot_mapping, torch.Tensor):
        changes["slot_mapping"] = remap(slot_mapping, SLOT_MAPPING)
    return dataclasses.replace(metadata, **changes)


def _with_backend_attributes(original: Any, copy: Any, runtime: KVPPRuntime, index: int) -> Any:
    """`copy` (remapped fields) with the attributes a backend's builder set on `original` outside its fields."""
    fields = {f.name for f in dataclasses.fields(original)}
    for name, value in vars(original).items():
        if name in fields:
            continue
        if name in TOKEN_TABLES:
            from vllm.v1.attention.backends.mla.amx_mla import _expand_block_table  # what its builder derives

            value = _expand_block_table(copy.block_table, runtime.plan.spec.block_size).to(value.dtype)
        elif name not in BLOCK_FREE_ATTRIBUTES:
            raise PackedMetadataError(
                f"layer {index}: {type(original).__name__} carries {name!r}, set by its backend outside its fields, "
                "which KVPP does not know how to remap to a packed scratch slot.")
        setattr(copy, name, value)
    return copy
