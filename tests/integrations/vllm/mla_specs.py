"""What the vLLM object cases (`cases_*.py`) share: vLLM's MLA cache specs as vLLM's models build them, the
attention layers' names, and KVPP on at TP 2. Imports vLLM: its importers import `triton_interpreter` first."""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole, get_kv_quant_mode

from kvpp_fx.integrations.vllm.setup.config import KVPPConfig

ON = KVPPConfig(enable_kvpp=True, tp=2)


def mla(block_size=16, head_size=576, dtype=torch.bfloat16, cache_dtype="auto", **extra):
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=head_size, dtype=dtype,
                            cache_dtype_str=cache_dtype, kv_quant_mode=get_kv_quant_mode(cache_dtype), **extra)


def indexer(block_size=16, head_dim=128 + 4):
    # As DeepseekV32IndexerCache.get_kv_cache_spec builds it: fp8 keys plus a 4-byte scale, one uint8 row.
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=head_dim,
                            dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)


def attn(i):
    return f"model.layers.{i}.self_attn.attn"
