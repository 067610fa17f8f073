"""Paged latent-cache ops of the reference model, in the ``kvpp_ref`` namespace.

Each op takes its layer's cache tensor as an operand plus the layer index, so the KVPP pass can
rebind the operand to ``kvpp.wait``'s output. Their `AttentionOpSpec`s are registered on import.

Cache layout: ``[num_blocks, block_size, kv_lora_rank + rope]``; token t of a request lives in block
``block_table[t // block_size]`` at offset ``t % block_size``. ``slot_mapping`` gives each new token's
flat slot (``block * block_size + offset``, or -1 for padding).
"""

from __future__ import annotations

import torch

from kvpp_fx.passes.registry import AttentionOpSpec, CacheOperand, register_attention_op


@torch.library.custom_op("kvpp_ref::write_kv", mutates_args=("cache",))
def write_kv(cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
             layer: int) -> None:
    """Write the new tokens' latent ``[kv_c | k_pe]`` into their slots."""
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
                  seq_lens: torch.Tensor, query_lens: torch.Tensor, scale: float, layer: int) -> torch.Tensor:
    """Absorbed MLA over the paged latent cache, causal within each request.

    q_latent ``[T, H, kv_lora_rank]`` (q_nope already multiplied by W_UK), q_pe ``[T, H, rope]``.
    Returns the attention-weighted latent ``[T, H, kv_lora_rank]`` (W_UV is applied by the caller).
    """
    rank = q_latent.shape[-1]
    out = torch.empty_like(q_latent)
    start = 0
    for row, (seq_len, q_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist())):
        if q_len == 0:
            continue
        ctx = gather_context(cache, block_table[row], seq_len).to(q_latent.dtype)
        kv_c, k_pe = ctx[:, :rank], ctx[:, rank:]
        q_l, q_p = q_latent[start:start + q_len], q_pe[start:start + q_len]
        scores = (torch.einsum("thc,sc->hts", q_l, kv_c) + torch.einsum("thr,sr->hts", q_p, k_pe)) * scale
        positions = torch.arange(seq_len - q_len, seq_len, device=scores.device)
        mask = torch.arange(seq_len, device=scores.device)[None, :] > positions[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
        out[start:start + q_len] = torch.einsum("hts,sc->thc", probs, kv_c)
        start += q_len
    return out


@mla_attention.register_fake
def _(q_latent, q_pe, cache, block_table, seq_lens, query_lens, scale, layer):
    return torch.empty_like(q_latent)


REFERENCE_SPECS = (
    AttentionOpSpec("kvpp_ref::write_kv", ("layer", 4), "index", (CacheOperand(("cache", 0), "kv"),)),
    AttentionOpSpec("kvpp_ref::mla_attention", ("layer", 7), "index", (CacheOperand(("cache", 2), "kv"),)),
)
for _spec in REFERENCE_SPECS:
    register_attention_op(_spec)
