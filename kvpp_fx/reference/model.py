"""Reference DeepSeek-V3-architecture decoder with tensor parallelism and a paged latent cache.

Parameter names follow HuggingFace ``DeepseekV3ForCausalLM`` so its safetensors load as they are,
each rank taking its shard: q heads and ``kv_b_proj`` rows split over TP ranks, ``o_proj`` and the MLP
row/column parallel with an all-reduce. The latent ``kv_c``/``k_pe`` is computed identically on every
rank, which is why the MLA cache is replicated under TP and why KVPP applies.

Attention reads and writes its layer's cache only through the ``kvpp_ref`` ops, which take the cache
tensor as an operand: that is what the KVPP pass rebinds. Decode and prefill both use the absorbed
form (q_nope x W_UK against the latent, then W_UV).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kvpp_fx.reference.ops  # noqa: F401  (registers the kvpp_ref ops)
from kvpp_fx.reference.config import RefConfig


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in its tensor-parallel group (size 1: no group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", self.group)


@dataclass(frozen=True)
class PPInfo:
    """This rank's pipeline stage. Stages hold contiguous layer ranges, earlier stages the extra layer."""

    stage: int = 0
    size: int = 1

    def layers(self, num_layers: int) -> tuple[int, ...]:
        if not 0 <= self.stage < self.size:
            raise ValueError(f"stage {self.stage} is outside a pipeline of {self.size} stages.")
        base, rem = divmod(num_layers, self.size)
        start = self.stage * base + min(self.stage, rem)
        return tuple(range(start, start + base + (1 if self.stage < rem else 0)))

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: RefConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale over the rope head dim (default RoPE or YaRN)."""
    params = config.rope_parameters
    base = float(params.get("rope_theta", 10000.0))
    dim = config.qk_rope_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    if params.get("rope_type", "default") == "default":
        return 1.0 / (base ** exponents), 1.0
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def softmax_scale(config: RefConfig) -> float:
    scale = config.qk_head_dim ** -0.5
    params = config.rope_parameters
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = 0.1 * params["mscale_all_dim"] * math.log(params["factor"]) + 1.0
        scale = scale * m * m
    return scale


class Rotary(nn.Module):
    def __init__(self, config: RefConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = config.rope_interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[T, heads, rope]``; cos/sin ``[T, rope]``. Same convention as HF DeepseekV3."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.interleave:
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass
class AttnInputs:
    """Per-step attention metadata (flattened token batch)."""

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor


class Indexer(nn.Module):
    """DeepSeek-V3.2 lightning indexer (replicated on every TP rank): picks the top-k context tokens."""

    def __init__(self, config: RefConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.rope_dim = config.qk_rope_head_dim
        self.wq = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def forward(self, x, rotary: Rotary, cos, sin, caches, meta: AttnInputs) -> torch.Tensor:
        T = x.shape[0]
        q = self.wq(x).view(T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(T, 1, self.head_dim)
        q = torch.cat([rotary.apply(q[..., :self.rope_dim], cos, sin), q[..., self.rope_dim:]], dim=-1)
        k = torch.cat([rotary.apply(k[..., :self.rope_dim], cos, sin), k[..., self.rope_dim:]], dim=-1)
        weights = self.weights_proj(x) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        _, data, scale = caches
        torch.ops.kvpp_ref.write_indexer(data, scale, k.view(T, self.head_dim), meta.slot_mapping, self.layer_idx)
        return torch.ops.kvpp_ref.indexer_topk(q, weights, data, scale, meta.block_table, meta.seq_lens,
                                               meta.query_lens, self.topk, self.layer_idx)


class MLAAttention(nn.Module):
    def __init__(self, config: RefConfig, layer_idx: int, tp: TPInfo) -> None:
        super().__init__()
        if config.num_attention_heads % tp.size:
            raise ValueError(f"{config.num_attention_heads} attention heads do not split over TP {tp.size}.")
        self.layer_idx, self.tp = layer_idx, tp
        self.heads = config.num_attention_heads // tp.size
        self.nope, self.rope, self.v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        hidden, qk = config.hidden_size, config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v, hidden, bias=False)
        self.scale = softmax_scale(config)
        self.indexer = Indexer(config, layer_idx) if config.is_sfa else None

    def forward(self, x, rotary: Rotary, cos, sin, caches, meta: AttnInputs) -> torch.Tensor:
        T = x.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, self.heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe = rotary.apply(q_pe, cos, sin)
        k_pe = rotary.apply(k_pe.view(T, 1, self.rope), cos, sin).view(T, self.rope)
        w_kv_b = self.kv_b_proj.weight.view(self.heads, self.nope + self.v, self.rank)
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_kv_b[:, : self.nope])
        # Everything between the cache write and the attention is a cache op, so the two share one
        # eager piece in PIECEWISE mode.
        kv_cache = caches[0]
        torch.ops.kvpp_ref.write_kv(kv_cache, kv_c, k_pe, meta.slot_mapping, self.layer_idx)
        topk = self.indexer(x, rotary, cos, sin, caches, meta) if self.indexer is not None else None
        latent = torch.ops.kvpp_ref.mla_attention(q_latent, q_pe, kv_cache, meta.block_table, meta.seq_lens,
                                                  meta.query_lens, self.scale, self.layer_idx, topk)
        out = torch.einsum("thr,hvr->thv", latent, w_kv_b[:, self.nope:]).reshape(T, self.heads * self.v)
        return self.tp.all_reduce(self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, config: RefConfig, tp: TPInfo) -> None:
        super().__init__()
        if config.intermediate_size % tp.size:
            raise ValueError(f"intermediate_size {config.intermediate_size} does not split over TP {tp.size}.")
        inter = config.intermediate_size // tp.size
        self.tp = tp
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: RefConfig, layer_idx: int, tp: TPInfo) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x, rotary, cos, sin, caches, meta: AttnInputs) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, cos, sin, caches, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    def __init__(self, config: RefConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 multi-token-prediction layer: predicts the token after next from the target's hidden."""

    def __init__(self, config: RefConfig, layer_idx: int, tp: TPInfo) -> None:
        super().__init__(config, layer_idx, tp)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def forward(self, embeds, hidden, rotary, cos, sin, caches, meta: AttnInputs) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(super().forward(x, rotary, cos, sin, caches, meta))


class Backbone(nn.Module):
    def __init__(self, config: RefConfig, tp: TPInfo) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)]
        layers += [MTPLayer(config, i, tp) for i in config.draft_layers]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ReferenceModel(nn.Module):
    """``forward`` runs the target layers; ``propose`` runs the MTP draft layer (if any)."""

    def __init__(self, config: RefConfig, tp: TPInfo | None = None, pp: PPInfo | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TPInfo()
        self.pp = pp or PPInfo()
        self.layer_ids = self.pp.layers(config.num_hidden_layers)
        self.model = Backbone(config, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)

    def forward(self, input_ids, positions, caches: list, slot_mapping, block_table, seq_lens, query_lens,
                logits_indices, hidden_in=None):
        """Logits at ``logits_indices`` and the final (normed) hidden state of every token.

        ``caches`` holds this stage's layers in order. A stage other than the first starts from
        ``hidden_in`` (the previous stage's output); a stage other than the last returns
        ``(None, hidden)`` for the next stage.
        """
        meta = AttnInputs(slot_mapping, block_table, seq_lens, query_lens)
        x = self.model.embed_tokens(input_ids) if self.pp.is_first else hidden_in
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for local, i in enumerate(self.layer_ids):
            x = self.model.layers[i](x, self.rotary, cos, sin, caches[local], meta)
        if not self.pp.is_last:
            return None, x
        hidden = self.model.norm(x)
        return self.lm_head(hidden[logits_indices]), hidden

    def propose(self, next_ids, hidden, positions, cache: list, slot_mapping, block_table, seq_lens, query_lens,
                logits_indices):
        """MTP draft logits: from the target's hidden at position p and the token at p+1, the token at p+2."""
        meta = AttnInputs(slot_mapping, block_table, seq_lens, query_lens)
        mtp = self.model.layers[self.config.num_hidden_layers]
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        out = mtp(self.model.embed_tokens(next_ids), hidden, self.rotary, cos, sin, cache, meta)
        return self.lm_head(out[logits_indices])
