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
- FLASHMLA, fp8 cache: vLLM's builder plans the step's dense-fp8 tiles (``get_mla_metadata_dense_fp8``) for
  the rank's query heads, times the DCP size under DCP. Owner calls get a plan of their own for the call's
  heads, made the same way once per step (`owner_metadata`).
- FLASH_ATTN_MLA (FA3): the ahead-of-time scheduler metadata is sized for ``num_heads x dcp``; an owner
  call given it could skip heads. Owner calls run with ``scheduler_metadata=None``, which FA3 plans itself.
- FLASHINFER_MLA: the kernel reads the head count from the query; the one buffer sized by heads, the
  multi-CTA counter, is sized once per layer from the first call: KVPP lets the first owner call size it
  again (larger serves both).
- CUTLASS_MLA: the kernel computes 128 heads through the query's strides, so the owner's query must have
  storage for 128 heads (vLLM's ``reserve_query_head_storage``, as DCP pads it), and more than 128 query
  heads are refused.
- AMX_MLA (CPU): allocates its decode buffers by its own head count: refused.

Any other backend is refused by name, and so is every sparse MLA backend (SFA models: DeepSeek-V3.2,
GLM-5) that is not registered as running a sparse owner call (`register_owner_backend`): one ``forward_mqa`` on
the owner over every rank's queries, reading the layer's top-k buffer that the owner's indexer just filled.
vLLM's GPU sparse backends (FlashMLA's and FlashInfer's) have none written yet.

fp8 caches: FLASHMLA, FLASHINFER_MLA and CUTLASS_MLA quantize the absorbed queries to fp8 before
``forward_mqa`` (``supports_quant_query_input``), with the layer's static ``_q_scale``, and their kernels
descale with it. Owner rows exchange those fp8 queries as they are, as DCP's all-gather does: the owner's
kernel descales every rank's heads with its own copy of the scale, which is the same number on every rank
(vLLM 0.32 has no dynamic query scales: 1.0 or the checkpoint's per-layer value, not sharded), and the
allocation checks that it is (`cache.allocation.check_scales`). TRITON_MLA dequantizes the cache inside its
kernel and keeps its queries unquantized. CUTLASS_MLA runs with scales of 1.0 only (vLLM's own refusal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
    sparse: bool = False  # a sparse MLA backend (SFA): its calls read the layer's top-k buffer
    # its metadata routes every token, prefill too, through forward_mqa as a decode row (vLLM's XPU sparse
    # builder does): a step's rows can all go to the owners, so an SFA model may take owner-only slots
    routes_every_token: bool = False


BACKENDS: dict[str, OwnerSupport] = {
    "CPU_MLA": OwnerSupport(True, "the kernel takes the head count from the query", 16, fp8_cache="none"),
    "TRITON_MLA": OwnerSupport(True, "one kernel call per rank's heads, so vLLM's logits workspace, reserved for "
                                     "the rank's heads, holds every call", 16, fp8_cache="unquantized queries",
                               calls_per_rank=True),
    "FLASHMLA": OwnerSupport(True, "owner calls get their own FlashMLASchedMeta per step, with an fp8 cache their "
                                   "own dense-fp8 tile plan for the call's heads", 64),
    "FLASH_ATTN_MLA": OwnerSupport(True, "owner calls run without the ahead-of-time scheduler metadata, which is "
                                         "sized for the rank's heads", 16, fp8_cache="none"),
    "FLASHINFER_MLA": OwnerSupport(True, "the kernel takes the head count from the query; the first owner call "
                                         "sizes the multi-CTA counter again", 32),
    "CUTLASS_MLA": OwnerSupport(True, "the owner's query gets storage for the kernel's 128 heads, as DCP pads it "
                                      "(at most 128 query heads)", 128),
    "AMX_MLA": OwnerSupport(False, "AMX_MLA allocates its decode buffers by its own head count", 128,
                            fp8_cache="none"),
}

CUTLASS_HEADS = 128


def owner_capable_backends(sparse: bool = False) -> list[str]:
    return sorted(name for name, support in BACKENDS.items() if support.owner_capable and support.sparse == sparse)


def register_owner_backend(name: str, support: OwnerSupport) -> None:
    """Declare how an attention backend vLLM knows by `name` (a plugin's, registered with vLLM's
    ``register_backend``) runs owner calls; an owner call then runs its impl's own ``forward_mqa``."""
    if name in BACKENDS and BACKENDS[name] != support:
        raise ValueError(f"attention backend {name} is already declared: {BACKENDS[name]}.")
    BACKENDS[name] = support


def owner_blocker(backend: str, sparse: bool = False) -> str | None:
    """Why `backend`'s decode rows cannot go to their owners (None: they can). ``sparse``: the model's MLA is
    sparse (SFA), so the backend must run a sparse owner call."""
    support = BACKENDS.get(backend)
    kind = "a sparse owner call" if sparse else "an owner call over the group's heads"
    if support is None or support.sparse != sparse:
        return (f"attention backend {backend} is not known to run {kind} (owner rows run on "
                f"{owner_capable_backends(sparse)})")
    if not support.owner_capable:
        return f"attention backend {backend} builds its decode metadata or workspace for its own heads ({support.how})"
    return None


# --- what an owner call needs, per backend -------------------------------------------------------------


def owner_metadata(backend: str, metadata: Any, query_heads: int, fp8_cache: bool) -> Any:
    """The metadata an owner call of this step reads: vLLM's, or a copy whose head-sized scheduling is the
    owner call's own, for its ``query_heads``. The caller keeps one per step (every owner call of a step
    shares it)."""
    decode = getattr(metadata, "decode", None)
    if decode is None:
        return metadata
    if backend == "FLASHMLA":
        return dataclasses.replace(metadata, decode=dataclasses.replace(
            decode, scheduler_metadata=flashmla_scheduling(metadata, query_heads, fp8_cache)))
    if backend == "FLASH_ATTN_MLA":
        return dataclasses.replace(metadata, decode=dataclasses.replace(decode, scheduler_metadata=None))
    return metadata


def flashmla_scheduling(metadata: Any, query_heads: int, fp8_cache: bool) -> Any:
    """A fresh FlashMLASchedMeta for an owner call: bf16 caches, empty (FlashMLA plans it in the call that
    first reads it); fp8 caches, the dense-fp8 tiles vLLM's builder plans, for ``query_heads`` instead of the
    rank's heads (decode requests have one query length, checked by vLLM's FlashMLA)."""
    from vllm.v1.attention.backends.mla.flashmla import FlashMLASchedMeta, get_mla_metadata_dense_fp8

    scheduling = FlashMLASchedMeta()
    if fp8_cache:
        tokens_per_request = -(-int(metadata.num_decode_tokens) // int(metadata.num_decodes))
        scheduling.tile_scheduler_metadata, scheduling.num_splits = get_mla_metadata_dense_fp8(
            metadata.decode.seq_lens, tokens_per_request * query_heads, 1)
    return scheduling


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
