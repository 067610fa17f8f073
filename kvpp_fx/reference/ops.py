"""Paged latent-cache ops of the reference model, in the ``kvpp_ref`` namespace.

Each op takes its layer's cache tensor as an operand plus the layer index, so the KVPP pass can
rebind the operand to ``kvpp.wait``'s output. Their `AttentionOpSpec`s are `REFERENCE_SPECS`, data that
a caller gives its backend (``kvpp_backend(plan, specs=REFERENCE_SPECS)``, as the reference engine
does); importing this module defines the ops and registers nothing, so what a compile recognises never
depends on what was imported. A backend built without them refuses the model's graph
(`StrayCacheReadError` or `NoGraphLayersError`, naming the op), and an op that still gets a KVPP handle
raises `UnboundCacheError`.

Cache layout: ``[num_blocks, block_size, kv_lora_rank + rope]``; token t of a request lives in block
``block_table[t // block_size]`` at offset ``t % block_size``. ``slot_mapping`` gives each new token's
flat slot (``block * block_size + offset``, or -1 for padding).
"""

from __future__ import annotations

import inspect
import os

import torch

from kvpp_fx.passes.registry import (
    AttentionOpSpec,
    CacheOperand,
    HeadOperand,
    HeadSeparable,
    OwnerLocal,
    RowOperands,
    TableOperand,
)


class UnboundCacheError(RuntimeError):
    """A cache op got a KVPP handle (no storage): the graph was not rebound for that layer."""


def require_storage(cache: torch.Tensor, layer: int) -> None:
    if cache.numel() > 1 and 0 in cache.stride():
        raise UnboundCacheError(
            f"layer {layer}: the cache operand is a KVPP cache handle, which holds no bytes: this op ran "
            f"outside every graph that kvpp_backend rewrote, called from {_calling_frame()}, a frame that ran "
            "uncompiled. Dynamo runs a frame as plain Python when it skips it (torch.compiler.disable, a "
            "skipped file) and when it has compiled the frame torch._dynamo.config.recompile_limit "
            f"({torch._dynamo.config.recompile_limit}) times: a graph break inside the layer loop makes Dynamo "
            "compile each layer's frame on its own, once per layer while it treats the layer index as a "
            "constant. Pass the layer index to the layer's forward as an argument (or set "
            "torch._dynamo.config.allow_unspec_int_on_nn_module = True), so that one compiled graph serves "
            "every layer (docs/graph-contract.md), and compile the model with kvpp_backend.")


def _calling_frame() -> str:
    """The innermost frame outside torch and this module: the model code that called the op."""
    torch_dir = os.path.dirname(torch.__file__)
    frame = inspect.currentframe()
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(torch_dir) and path != __file__:
            return f"{frame.f_code.co_qualname} ({path}:{frame.f_lineno})"
        frame = frame.f_back
    return "an unknown frame"


@torch.library.custom_op("kvpp_ref::write_kv", mutates_args=("cache",))
def write_kv(cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
             layer: int) -> None:
    """Write the new tokens' latent ``[kv_c | k_pe]`` into their slots."""
    require_storage(cache, layer)
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = torch.cat([kv_c, k_pe], dim=-1)[keep].to(cache.dtype)


@write_kv.register_fake
def _(cache, kv_c, k_pe, slot_mapping, layer):
    return None


def gather_context(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one request, ``[length, width]``, read through its block table."""
    block_size = cache.shape[1]
    blocks = (length + block_size - 1) // block_size
    return cache[block_row[:blocks].long()].reshape(-1, cache.shape[-1])[:length]


@torch.library.custom_op("kvpp_ref::mla_attention", mutates_args=())
def mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, query_lens: torch.Tensor, scale: float, layer: int,
                  topk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA over the paged latent cache, causal within each request.

    q_latent ``[T, H, kv_lora_rank]`` (q_nope already multiplied by W_UK), q_pe ``[T, H, rope]``.
    Returns the attention-weighted latent ``[T, H, kv_lora_rank]`` (W_UV is applied by the caller).
    With ``topk_indices`` ``[T, k]`` (context positions, -1 for none), each query attends only to its
    selected tokens: sparse (SFA) attention.
    """
    require_storage(cache, layer)
    rank = q_latent.shape[-1]
    out = torch.empty_like(q_latent)
    start = 0
    for row, (seq_len, q_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist())):
        if q_len == 0:
            continue
        ctx = gather_context(cache, block_table[row], seq_len).to(q_latent.dtype)
        kv_c, k_pe = ctx[:, :rank], ctx[:, rank:]
        heads = q_latent.shape[1]
        # Batched over heads (one GEMM per head, never heads folded into the rows), so a head's result
        # does not depend on how many heads the call holds: owner mode runs all heads in one call.
        q_l = q_latent[start:start + q_len].transpose(0, 1)
        q_p = q_pe[start:start + q_len].transpose(0, 1)
        scores = (torch.bmm(q_l, kv_c.t().expand(heads, -1, -1))
                  + torch.bmm(q_p, k_pe.t().expand(heads, -1, -1))) * scale
        positions = torch.arange(seq_len - q_len, seq_len, device=scores.device)
        mask = torch.arange(seq_len, device=scores.device)[None, :] > positions[:, None]
        if topk_indices is not None:
            chosen = topk_indices[start:start + q_len].long()
            selected = torch.zeros(q_len, seq_len + 1, dtype=torch.bool, device=scores.device)
            selected.scatter_(1, torch.where(chosen < 0, seq_len, chosen), True)
            mask = mask | ~selected[:, :seq_len]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
        out[start:start + q_len] = torch.bmm(probs, kv_c.expand(heads, -1, -1)).transpose(0, 1)
        start += q_len
    return out


@mla_attention.register_fake
def _(q_latent, q_pe, cache, block_table, seq_lens, query_lens, scale, layer, topk_indices=None):
    return torch.empty_like(q_latent)


@torch.library.custom_op("kvpp_ref::write_indexer", mutates_args=("data", "scale"))
def write_indexer(data: torch.Tensor, scale: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor,
                  layer: int) -> None:
    """Quantize the indexer keys per token (int8 data + fp32 scale, fp8-style) and write their slots."""
    require_storage(data, layer)
    require_storage(scale, layer)
    keep = slot_mapping >= 0
    amax = k.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8)
    token_scale = amax / 127.0
    quantized = torch.round(k / token_scale).clamp(-127, 127).to(torch.int8)
    data.view(-1, data.shape[-1])[slot_mapping[keep]] = quantized[keep]
    scale.view(-1, 1)[slot_mapping[keep]] = token_scale[keep].to(scale.dtype)


@write_indexer.register_fake
def _(data, scale, k, slot_mapping, layer):
    return None


@torch.library.custom_op("kvpp_ref::indexer_topk", mutates_args=())
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor, topk: int,
                 layer: int) -> torch.Tensor:
    """Lightning-indexer token selection: ``sum_h w[t,h] * relu(q[t,h] . k[s])`` over causal context,
    top-k per query token as context positions ``[T, topk]`` (-1 where the context is shorter)."""
    require_storage(data, layer)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    start = 0
    for row, (seq_len, q_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist())):
        if q_len == 0:
            continue
        keys = gather_context(data, block_table[row], seq_len).float()
        keys = keys * gather_context(scale, block_table[row], seq_len).float()
        logits = torch.relu(torch.einsum("thd,sd->ths", q[start:start + q_len].float(), keys))
        index_scores = torch.einsum("ths,th->ts", logits, weights[start:start + q_len].float())
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > positions[:, None]
        index_scores = index_scores.masked_fill(future, float("-inf"))
        k = min(topk, seq_len)
        chosen = index_scores.topk(k, dim=-1).indices
        valid = torch.gather(~future, 1, chosen)
        out[start:start + q_len, :k] = torch.where(valid, chosen, torch.full_like(chosen, -1))
        start += q_len
    return out


@indexer_topk.register_fake
def _(q, weights, data, scale, block_table, seq_lens, query_lens, topk, layer):
    return q.new_empty((q.shape[0], topk), dtype=torch.int64)


# Owner mode: attention is head-separable (q_latent and q_pe carry the TP rank's heads on dim 1, and so
# does the output), and its call cuts by request for hybrid forwards; the writes and the indexer's top-k
# run on the owner only in owner mode, and on every rank in hybrid forwards (the indexer's heads are
# replicated over TP, as in DeepSeek-V3.2, so the owner's own queries are all of them).
BLOCK_TABLE = TableOperand(("block_table", 3), "block_table")
SLOT_MAPPING = TableOperand(("slot_mapping", 3), "slot_mapping")
REFERENCE_SPECS = (
    AttentionOpSpec("kvpp_ref::write_kv", ("layer", 4), "index", (CacheOperand(("cache", 0), "kv"),),
                    owner=OwnerLocal(), tables=(SLOT_MAPPING,)),
    AttentionOpSpec("kvpp_ref::mla_attention", ("layer", 7), "index", (CacheOperand(("cache", 2), "kv"),),
                    owner=HeadSeparable((HeadOperand(("q_latent", 0), 1), HeadOperand(("q_pe", 1), 1)),
                                        output_dim=1,
                                        rows=RowOperands((("q_latent", 0), ("q_pe", 1), ("topk_indices", 8)),
                                                         (("block_table", 3), ("seq_lens", 4), ("query_lens", 5)),
                                                         ("query_lens", 5))),
                    tables=(BLOCK_TABLE,)),
    AttentionOpSpec("kvpp_ref::write_indexer", ("layer", 4), "index",
                    (CacheOperand(("data", 0), "indexer"), CacheOperand(("scale", 1), "indexer_scale")),
                    owner=OwnerLocal(), tables=(SLOT_MAPPING,)),
    AttentionOpSpec("kvpp_ref::indexer_topk", ("layer", 8), "index",
                    (CacheOperand(("data", 2), "indexer"), CacheOperand(("scale", 3), "indexer_scale")),
                    owner=OwnerLocal(), tables=(TableOperand(("block_table", 4), "block_table"),)),
)
