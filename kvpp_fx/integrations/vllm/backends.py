"""vLLM's MLA decode backends and owner rows: which can run an owner call, and what KVPP does for each.

An owner call is one ``impl.forward_mqa`` on a layer's owner over every rank's absorbed queries: ``[T, H x G,
kv_lora_rank + rope]`` for H heads per rank and a group of G, in a step whose other layers call the same
kernel with H heads and share the step's metadata object (vLLM builds it once per step). vLLM's decode
context parallelism (DCP) all-gathers query heads the same way and is the precedent: where a backend
sizes something for DCP, KVPP sizes it through the same path.

Per backend (read from vLLM 0.32's sources; only CPU_MLA and TRITON_MLA run on this project's CPU hosts):

- CPU_MLA: the kernel takes the head count from the query, nothing is sized by heads. As is.
- TRITON_MLA: nothing per step depends on heads, but its split-KV logits workspace is reserved for the
  rank's heads (``num_heads x dcp_world_size``) before vLLM locks its workspace, so a larger owner call
  would fail once locked. KVPP reserves it again through vLLM's own DCP sizing, on a copy of each metadata
  builder whose ``dcp_world_size`` is multiplied by G (`reserve_owner_workspaces`).
- FLASHMLA, bf16 cache: the step's ``FlashMLASchedMeta`` is planned by its first call and asserts the same
  head count in every later call. Owner calls get their own, one fresh instance per step shared by every
  owner call of that step (`owner_metadata`), as vLLM's DeepSeek-V4 layers keep one per layer type.
- FLASHMLA, fp8 cache: its dense-fp8 metadata is sized by the rank's heads (correct for more heads, per the
  kernel's source, but over-subscribed); its queries are quantized to fp8, which owner rows do not
  exchange: refused (`FP8_QUERIES`), so "auto" broadcasts.
- FLASH_ATTN_MLA (FA3): the ahead-of-time scheduler metadata is sized for ``num_heads x dcp``; an owner
  call given it could skip heads. Owner calls run with ``scheduler_metadata=None``, which FA3 plans itself.
- FLASHINFER_MLA: the kernel reads the head count from the query; the one buffer sized by heads, the
  multi-CTA counter, is sized once per layer from the first call: KVPP lets the first owner call size it
  again (larger serves both).
- CUTLASS_MLA: the kernel computes 128 heads through the query's strides, so the owner's query must have
  storage for 128 heads (vLLM's ``reserve_query_head_storage``, as DCP pads it), and more than 128 query
  heads are refused.
- AMX_MLA (CPU): allocates its decode buffers by its own head count: refused.

Any other backend is refused by name. fp8 queries are refused on every backend: they carry the scale
their rank quantized them with.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OwnerSupport:
    """Whether a backend's decode rows can go to their owners, and how (or why not)."""

    owner_capable: bool
    how: str  # what KVPP does for an owner call, or why it cannot run one
    block_size: int | None = None  # the kernel block size vLLM 0.32 uses for DeepSeek-V3 (kvpp-fx plan)


BACKENDS: Mapping[str, OwnerSupport] = {
    "CPU_MLA": OwnerSupport(True, "the kernel takes the head count from the query", 16),
    "TRITON_MLA": OwnerSupport(True, "its logits workspace is reserved again for the group's heads through vLLM's "
                                     "DCP sizing, before vLLM locks its workspace", 16),
    "FLASHMLA": OwnerSupport(True, "owner calls get their own FlashMLASchedMeta per step (bf16 caches; fp8 caches "
                                   "quantize the queries, which owner rows do not exchange)", 64),
    "FLASH_ATTN_MLA": OwnerSupport(True, "owner calls run without the ahead-of-time scheduler metadata, which is "
                                         "sized for the rank's heads", 16),
    "FLASHINFER_MLA": OwnerSupport(True, "the kernel takes the head count from the query; the first owner call "
                                         "sizes the multi-CTA counter again", 32),
    "CUTLASS_MLA": OwnerSupport(True, "the owner's query gets storage for the kernel's 128 heads, as DCP pads it "
                                      "(at most 128 query heads)", 128),
    "AMX_MLA": OwnerSupport(False, "AMX_MLA allocates its decode buffers by its own head count", 128),
}

FP8_QUERIES = ("the KV cache is fp8 and {backend} quantizes the queries for it; owner rows exchange unquantized "
               "queries only")
CUTLASS_HEADS = 128


def owner_capable_backends() -> list[str]:
    return sorted(name for name, support in BACKENDS.items() if support.owner_capable)


def owner_blocker(backend: str, quantized_queries: bool = False) -> str | None:
    """Why `backend`'s decode rows cannot go to their owners (None: they can). ``quantized_queries``: the
    backend quantizes its queries for an fp8 cache (vLLM's ``impl.supports_quant_query_input``)."""
    support = BACKENDS.get(backend)
    if support is None:
        return (f"attention backend {backend} is not known to run an owner call over the group's heads "
                f"(owner rows run on {owner_capable_backends()})")
    if not support.owner_capable:
        return f"attention backend {backend} builds its decode metadata or workspace for its own heads ({support.how})"
    if quantized_queries:
        return FP8_QUERIES.format(backend=backend)
    return None


# --- what an owner call needs, per backend -------------------------------------------------------------


def owner_metadata(backend: str, metadata: Any) -> Any:
    """The metadata an owner call of this step reads: vLLM's, or a copy whose head-sized scheduling is the
    owner call's own. The caller keeps one per step (every owner call of a step shares it)."""
    decode = getattr(metadata, "decode", None)
    if decode is None:
        return metadata
    if backend == "FLASHMLA":
        from vllm.v1.attention.backends.mla.flashmla import FlashMLASchedMeta

        fresh = dataclasses.replace(decode, scheduler_metadata=FlashMLASchedMeta())
        return dataclasses.replace(metadata, decode=fresh)
    if backend == "FLASH_ATTN_MLA":
        return dataclasses.replace(metadata, decode=dataclasses.replace(decode, scheduler_metadata=None))
    return metadata


def owner_query(backend: str, query: Any) -> Any:
    """The owner call's query, as the backend's kernel must see it."""
    if backend != "CUTLASS_MLA":
        return query
    if query.shape[1] > CUTLASS_HEADS:
        raise ValueError(f"CUTLASS_MLA computes at most {CUTLASS_HEADS} query heads; an owner call has {query.shape[1]}.")
    from vllm.v1.attention.ops.dcp import reserve_query_head_storage

    return reserve_query_head_storage(query, CUTLASS_HEADS)


def before_owner_call(backend: str, impl: Any) -> None:
    """What an impl needs before its first owner call: FLASHINFER_MLA sizes its multi-CTA counter again."""
    if backend == "FLASHINFER_MLA" and not getattr(impl, "_kvpp_owner_sized", False):
        impl._mla_counter_bytes = None
        impl._kvpp_owner_sized = True


def reserve_owner_workspaces(attn_groups: Any, group_size: int) -> int:
    """TRITON_MLA: reserve each metadata builder's logits workspace again for ``group_size`` times the
    rank's heads, through vLLM's own DCP sizing on a copy of the builder (vLLM's builder is not changed),
    while the workspace can still grow. Returns the builders reserved for (0 without a workspace manager,
    as on CPU)."""
    from vllm.v1.worker.workspace import is_workspace_manager_initialized

    if group_size <= 1 or not is_workspace_manager_initialized():
        return 0
    reserved = 0
    for groups in attn_groups:
        for group in groups:
            if group.backend.get_name() != "TRITON_MLA":
                continue
            for builder in getattr(group, "metadata_builders", ()):
                owner = copy.copy(builder)
                owner.dcp_world_size = builder.dcp_world_size * group_size
                owner._reserve_attn_logits_workspace()
                reserved += 1
    return reserved
