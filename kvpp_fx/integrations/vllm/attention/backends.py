"""vLLM's MLA decode backends and owner rows: which can run an owner call, and what KVPP does for each.

An owner call is one ``impl.forward_mqa`` on a layer's owner over every rank's absorbed queries: ``[T, H x G,
kv_lora_rank + rope]`` for H heads per rank and a group of G, in a step whose other layers call the same
kernel with H heads and share the step's metadata object (vLLM builds it once per step). vLLM's decode
context parallelism (DCP) all-gathers query heads the same way and is the precedent: where a backend
sizes something for DCP, KVPP sizes it through the same path.

Per backend (read from vLLM 0.32's sources; only CPU_MLA and TRITON_MLA run on this project's CPU hosts):

- CPU_MLA: the kernel takes the head count from the query, nothing is sized by heads. As is.
- TRITON_MLA: nothing per step depends on heads, but its split-KV logits workspace is reserved for the
  rank's heads (``max rows x num_heads x dcp_world_size x splits(max_model_len)``, float32) before vLLM
  locks its workspace, so a call over G times the heads fails once locked. Reserving G times that is no
  answer: DeepSeek-V3 at TP 8 on an H200 (160K context, 1024 sequences) reserves 8.3 GiB per rank, and
  would need 66 GiB for the group's heads. The owner runs the kernel once per rank's heads instead
  (`owner_call`): G calls, each of the shape the rank's own call has, so vLLM's reservation holds them
  and no byte is added.
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

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OwnerSupport:
    """Whether a backend's decode rows can go to their owners, and how (or why not)."""

    owner_capable: bool
    how: str  # what KVPP does for an owner call, or why it cannot run one
    block_size: int | None = None  # the kernel block size vLLM 0.32 uses for DeepSeek-V3 (kvpp-fx plan)
    fp8_cache: str = "quantized queries"  # with an fp8 cache: "quantized queries", "unquantized queries", "none"
    calls_per_rank: bool = False  # the owner runs one kernel call per rank's heads, not one over all of them


BACKENDS: Mapping[str, OwnerSupport] = {
    "CPU_MLA": OwnerSupport(True, "the kernel takes the head count from the query", 16, fp8_cache="none"),
    "TRITON_MLA": OwnerSupport(True, "one kernel call per rank's heads, so vLLM's logits workspace, reserved for "
                                     "the rank's heads, holds every call", 16, fp8_cache="unquantized queries",
                               calls_per_rank=True),
    "FLASHMLA": OwnerSupport(True, "owner calls get their own FlashMLASchedMeta per step (bf16 caches; fp8 caches "
                                   "quantize the queries, which owner rows do not exchange)", 64),
    "FLASH_ATTN_MLA": OwnerSupport(True, "owner calls run without the ahead-of-time scheduler metadata, which is "
                                         "sized for the rank's heads", 16, fp8_cache="none"),
    "FLASHINFER_MLA": OwnerSupport(True, "the kernel takes the head count from the query; the first owner call "
                                         "sizes the multi-CTA counter again", 32),
    "CUTLASS_MLA": OwnerSupport(True, "the owner's query gets storage for the kernel's 128 heads, as DCP pads it "
                                      "(at most 128 query heads)", 128),
    "AMX_MLA": OwnerSupport(False, "AMX_MLA allocates its decode buffers by its own head count", 128,
                            fp8_cache="none"),
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
        raise ValueError(f"CUTLASS_MLA computes at most {CUTLASS_HEADS} query heads; an owner call has "
                         f"{query.shape[1]}.")
    from vllm.v1.attention.ops.dcp import reserve_query_head_storage

    return reserve_query_head_storage(query, CUTLASS_HEADS)


def before_owner_call(backend: str, impl: Any) -> None:
    """What an impl needs before its first owner call: FLASHINFER_MLA sizes its multi-CTA counter again."""
    if backend == "FLASHINFER_MLA" and not getattr(impl, "_kvpp_owner_sized", False):
        impl._mla_counter_bytes = None
        impl._kvpp_owner_sized = True


def owner_call(backend: str, forward_mqa: Callable[[Any, Any], Any], query: Any, metadata: Any,
               rank_heads: int) -> Any:
    """The owner's attention over every rank's heads ``query`` ``[T, rank_heads x G, L + R]``: one call of
    ``forward_mqa(query, metadata)``, or, where the backend sizes its workspace by the rank's heads, one
    call per rank's heads (each exactly the shape of that rank's own call), concatenated in rank order."""
    if BACKENDS[backend].calls_per_rank and query.shape[1] > rank_heads:
        import torch

        return torch.cat([forward_mqa(part.contiguous(), metadata) for part in query.split(rank_heads, dim=1)],
                         dim=1)
    return forward_mqa(owner_query(backend, query), metadata)
