"""Test-only: vLLM 0.32's DeepSeek-V3.2 classes (MLA with DeepSeek's sparse attention: a "lightning indexer"
selects each token's top-k context positions, and the MLA attends over those) on vLLM CPU, which refuses sparse
attention ("Sparse Attention is not supported on CPU.") and has DeepSeek-V4's indexer only.

Applied in every process of an engine whose environment sets `ENV` (the TP workers are spawned and re-run the
entry module, which imports this one). vLLM's model (on CPU, `deepseek_v2.DeepseekV3ForCausalLM` with its
`Indexer`), layers, metadata builders and runner run as they are; these stand in for CUDA kernels, in torch:

- `CpuPlatform.get_attn_backend_cls` returns `CPUSparseMLABackend` for sparse MLA: vLLM's XPU sparse MLA
  backend (its metadata builder, which routes every token, prefill included, through ``forward_mqa``) with a
  torch impl: the latent rows at each token's top-k logical positions (through the block table), softmax,
  values; a torch cache write (the CUDA ``concat_and_cache_mla``'s bytes); float32 allowed;
- `SparseAttnIndexer.forward_cpu` (DeepSeek-V4's, which refuses the key write V3.2's indexer asks for): the
  indexer keys written as vLLM lays out its indexer cache (per block, e4m3 keys then one float32 power-of-two
  scale per token), then for every token the weighted ReLU logits over its request's earlier keys and their
  top-k logical positions (-1 where fewer) into the layer's top-k buffer;
- ``deepseek_v2.per_token_group_quant_fp8``: torch (its CPU path is a Triton kernel, slow interpreted);
- vLLM's dummy weights: `deepseek_v4_on_cpu.load_weights` (seeded per module and TP rank, +-0.1);
- KVPP is told (`register_owner_backend`, its seam for a plugin's backend) that the stand-in runs sparse owner
  calls: its ``forward_mqa`` takes the heads from the query and reads the layer's top-k buffer.

- the indexer cache's kernel block sizes: 16 as well as 64 (vLLM CPU gives MLA models blocks of 16 without
  AMX, or where CPU_MLA is named; the torch indexer reads any block size).

Both stand-ins are checked against the reference engine's SFA ops (`kvpp_ref::indexer_topk`,
`kvpp_ref::mla_attention` with top-k indices) and the indexer against vLLM CPU's own DeepSeek-V4 indexer
kernels (``fp8_paged_mqa_logits_cpu``, ``topk_transform_512_cpu``) in `cases_deepseek_v32`.
"""

from __future__ import annotations

import os

import torch

ENV = "KVPP_TESTS_DEEPSEEK_V32"
_APPLIED = "_kvpp_tests_deepseek_v32"
FP8_MAX = 448.0
# what the indexers of this process did (`indexer_stats`): calls, the longest context, the most positions one
# token selected, and the tokens whose context was longer than the top-k (where the indexer selects)
STATS = {"indexer_calls": 0, "max_context": 0, "max_selected": 0, "rows_truncated": 0}


# ----------------------------------------------------------------------------------------------------------
# sparse MLA backend (torch reference)
# ----------------------------------------------------------------------------------------------------------
def _backend_classes():
    from vllm.v1.attention.backends.mla.xpu_mla_sparse import (XPUMLASparseBackend, XPUMLASparseImpl,
                                                             XPUMLASparseMetadataBuilder)

    class CPUSparseMLAImpl(XPUMLASparseImpl):
        """Top-k sparse MQA over the latent cache in torch; every token (prefill too) goes through forward_mqa."""

        def record_logical_topk_ready(self) -> None:  # SparseMLACommonImpl's may record a (CUDA) event
            return None

        def prepare_for_batch(self, attn_metadata) -> None:
            return None

        def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
            if kv_cache.numel() == 0:
                return None
            slots = slot_mapping.flatten().long()
            n = slots.shape[0]
            rows = torch.cat([kv_c_normed[:n], k_pe[:n].reshape(n, -1)], dim=-1)
            valid = slots >= 0
            slots, rows = slots[valid], rows[valid]
            block_size = kv_cache.shape[1]
            kv_cache[slots // block_size, slots % block_size] = rows.to(kv_cache.dtype)
            return None

        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            if isinstance(q, tuple):
                q = torch.cat(q, dim=-1)
            num_tokens = q.shape[0]
            topk = self.topk_indices_buffer[:num_tokens, : attn_metadata.topk_tokens].long()
            block_size = kv_c_and_k_pe_cache.shape[1]
            req = attn_metadata.req_id_per_token[:num_tokens].long()
            tables = attn_metadata.block_table.long()
            out = q.new_zeros(num_tokens, q.shape[1], self.kv_lora_rank)
            chunk = 32
            for start in range(0, num_tokens, chunk):
                idx = topk[start:start + chunk]  # [t, K] logical positions, -1 invalid
                valid = idx >= 0
                pos = idx.clamp(min=0)
                blocks = torch.gather(tables[req[start:start + chunk]], 1, pos // block_size)
                kv = kv_c_and_k_pe_cache[blocks, pos % block_size].float()  # [t, K, 576]
                qs = q[start:start + chunk].float()  # [t, H, 576]
                scores = torch.einsum("thd,tkd->thk", qs, kv) * self.softmax_scale
                scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
                probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
                out[start:start + chunk] = torch.einsum("thk,tkd->thd", probs, kv[..., : self.kv_lora_rank]).to(
                    out.dtype)
            return out, None

    class CPUSparseMLABackend(XPUMLASparseBackend):
        supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]

        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return CPUSparseMLAImpl

        @staticmethod
        def get_builder_cls():
            return XPUMLASparseMetadataBuilder

    return CPUSparseMLABackend, CPUSparseMLAImpl


def __getattr__(name):  # vLLM resolves the backend by class path in every process
    if name in ("CPUSparseMLABackend", "CPUSparseMLAImpl"):
        backend, impl = _backend_classes()
        globals().update(CPUSparseMLABackend=backend, CPUSparseMLAImpl=impl)
        return globals()[name]
    raise AttributeError(name)


# ----------------------------------------------------------------------------------------------------------
# indexer (torch)
# ----------------------------------------------------------------------------------------------------------
def quant_fp8_ue8m0(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, group) e4m3 quantization with power-of-two scales: what the CUDA/Triton kernels do."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // group, group)
    scale = g.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(shape), scale.reshape(*shape[:-1], shape[-1] // group)


def per_token_group_quant_fp8(x, group_size, eps=1e-10, dtype=None, column_major_scales=False,
                              tma_aligned_scales=False, out_q=None, use_ue8m0=None):
    assert not column_major_scales
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    scale = g.abs().amax(-1).clamp(min=eps) / FP8_MAX
    if use_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(x.shape)
    if out_q is not None:
        out_q.copy_(q)
        q = out_q
    return q, scale


def _cache_views(kv_cache: torch.Tensor, head_dim: int):
    """vLLM's indexer cache block layout: per block, block_size x head_dim e4m3 values, then block_size fp32
    scales ([num_blocks, block_size, head_dim + 4] uint8 as allocated)."""
    num_blocks, block_size, width = kv_cache.shape
    flat = kv_cache.as_strided((num_blocks, block_size * width), (kv_cache.stride(0), 1))
    values = flat[:, : block_size * head_dim].view(torch.float8_e4m3fn).unflatten(1, (block_size, head_dim))
    scales = flat[:, block_size * head_dim:].view(torch.float32)
    return values, scales


def _write_k(kv_cache, k, slot_mapping, head_dim):
    values, scales = _cache_views(kv_cache, head_dim)
    block_size = kv_cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0
    q, s = quant_fp8_ue8m0(k[valid], head_dim)
    slots = slots[valid]
    values[slots // block_size, slots % block_size] = q
    scales[slots // block_size, slots % block_size] = s[:, 0]


def _read_k(kv_cache, table_row: torch.Tensor, length: int, head_dim: int) -> torch.Tensor:
    """Dequantized keys of logical positions 0..length-1 of one request."""
    values, scales = _cache_views(kv_cache, head_dim)
    block_size = kv_cache.shape[1]
    pos = torch.arange(length)
    blocks = table_row.long()[pos // block_size]
    return values[blocks, pos % block_size].float() * scales[blocks, pos % block_size][:, None]


def _score_rows(q, weights, keys, lengths, topk, out):
    """q [t, H, D] fp8, weights [t, H], keys [S, D], lengths [t] (causal lengths): top-k positions -> out."""
    logits = torch.einsum("thd,sd->ths", q.float(), keys).relu()
    logits = (logits * weights.float()[:, :, None]).sum(1)  # [t, S]
    S = keys.shape[0]
    mask = torch.arange(S)[None, :] >= lengths[:, None]
    logits = logits.masked_fill(mask, float("-inf"))
    k = min(topk, S)
    vals, idx = logits.topk(k, dim=-1)
    idx = idx.masked_fill(vals == float("-inf"), -1).to(out.dtype)
    out.fill_(-1)
    out[:, :k] = idx
    STATS["max_context"] = max(STATS["max_context"], int(lengths.max()))
    STATS["max_selected"] = max(STATS["max_selected"], int((idx >= 0).sum(-1).max()))
    STATS["rows_truncated"] += int((lengths > topk).sum())


def indexer_forward_cpu(self, hidden_states, q_quant, k, weights):
    """Replaces SparseAttnIndexer.forward_cpu (DeepSeek-V4-only there) for V3.2: cache write + top-k."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):
        return self.topk_indices_buffer
    m = metadata[self.k_cache.prefix]
    kv_cache = self.k_cache.kv_cache
    head_dim = self.head_dim
    num_tokens = m.slot_mapping.shape[0]
    if not self.skip_k_cache_insert:
        _write_k(kv_cache, k[:num_tokens], m.slot_mapping, head_dim)
    buffer = self.topk_indices_buffer
    buffer[: hidden_states.shape[0]] = -1
    STATS["indexer_calls"] += 1
    topk = self.topk_tokens
    if m.num_decodes > 0:
        d = m.decode
        seq_lens = d.seq_lens[:, -1] if d.seq_lens.ndim == 2 else d.seq_lens
        for t in range(m.num_decode_tokens):
            length = int(seq_lens[t])
            keys = _read_k(kv_cache, d.block_table[t], length, head_dim)
            _score_rows(q_quant[t:t + 1], weights[t:t + 1], keys, seq_lens[t:t + 1].long(), topk,
                        buffer[t:t + 1, :topk])
    if m.num_prefills > 0:
        for chunk in m.prefill.chunks:
            lengths = (chunk.cu_seqlen_ke - chunk.cu_seqlen_ks).long()
            req = torch.searchsorted(chunk.local_cu_seq_lens, chunk.cu_seqlen_ks, right=True) - 1
            for r in req.unique().tolist():
                rows = (req == r).nonzero().flatten()
                a, b = int(rows[0]), int(rows[-1]) + 1
                keys = _read_k(kv_cache, chunk.block_table[r], int(lengths[a:b].max()), head_dim)
                t0 = chunk.token_start
                _score_rows(q_quant[t0 + a:t0 + b], weights[t0 + a:t0 + b], keys, lengths[a:b], topk,
                            buffer[t0 + a:t0 + b, :topk])
    return buffer


# ----------------------------------------------------------------------------------------------------------
def apply() -> None:
    import vllm.model_executor.model_loader.dummy_loader as dummy_loader
    import vllm.model_executor.models.deepseek_v2 as deepseek_v2
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.platforms.cpu import CpuPlatform

    from kvpp_fx.integrations.vllm.attention.backends import OwnerSupport, register_owner_backend
    from tests.integrations.vllm.deepseek_v4_on_cpu import load_weights

    if getattr(CpuPlatform, _APPLIED, False):
        return
    original = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse and attn_selector_config.use_mla:
            return f"{__name__}.CPUSparseMLABackend"
        return original(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    # KVPP's seam for a plugin's attention backend: the stand-in's forward_mqa takes its heads from the query
    # and reads the layer's top-k buffer, so one call on the owner serves every rank's heads
    register_owner_backend("CUSTOM", OwnerSupport(True, "the torch stand-in (tests): heads from the query", 16,
                                                  fp8_cache="none", sparse=True, routes_every_token=True))
    # vLLM CPU gives MLA models blocks of 16 without AMX (and where CPU_MLA is named); the torch indexer takes any
    deepseek_v2.DeepseekV32IndexerBackend.get_supported_kernel_block_sizes = staticmethod(
        lambda kv_cache_spec=None: [16, 64])
    SparseAttnIndexer.forward_cpu = indexer_forward_cpu
    deepseek_v2.per_token_group_quant_fp8 = per_token_group_quant_fp8
    dummy_loader.DummyModelLoader.load_weights = load_weights
    setattr(CpuPlatform, _APPLIED, True)


def indexer_stats(_worker=None) -> dict:
    """What this process's indexers did (a worker's, through ``collective_rpc``)."""
    return dict(STATS)


if os.environ.get(ENV):
    apply()
