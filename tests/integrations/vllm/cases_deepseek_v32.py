"""The torch stand-ins that run vLLM's DeepSeek-V3.2 classes on vLLM CPU (`deepseek_v32_on_cpu`), against the
reference engine's SFA ops and vLLM CPU's own indexer kernels: what the engine tests' tokens rest on.

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM)

import types

import torch

import kvpp_fx.reference.ops  # noqa: F401  (defines the kvpp_ref ops)
from tests.integrations.vllm import deepseek_v32_on_cpu as v32

LENGTHS = [1, 300, 512, 513, 700]  # context lengths of five decode tokens: the last two longer than the top-k


def _indexer_cache(head_dim: int, block: int, blocks: int, length: int):
    """One request's `length` indexer keys in vLLM's indexer cache layout, through a shuffled block table."""
    torch.manual_seed(0)
    cache = torch.zeros(blocks, block, head_dim + 4, dtype=torch.uint8)
    table = torch.randperm(blocks)[: -(-length // block)].int()
    slots = table.long()[torch.arange(length) // block] * block + torch.arange(length) % block
    v32._write_k(cache, torch.randn(length, head_dim), slots, head_dim)
    return cache, table


def test_the_torch_indexer_selects_what_vllms_cpu_kernels_and_the_reference_engine_select():
    """Five decode tokens over one paged cache of 700 keys, top-k 512: the stand-in's logits equal vLLM CPU's
    ``fp8_paged_mqa_logits_cpu`` (DeepSeek-V4's) within float32 rounding, and its top-k sets equal those of
    ``topk_transform_512_cpu`` and of the reference engine's `kvpp_ref::indexer_topk` over the same keys. Where
    the context is longer than 512 the sets are a selection (the control: not every position)."""
    import vllm._custom_ops as ops

    heads, head_dim, block, topk = 4, 128, 64, 512
    cache, table = _indexer_cache(head_dim, block, 24, max(LENGTHS))
    keys = v32._read_k(cache, table, max(LENGTHS), head_dim)
    q, q_scale = v32.per_token_group_quant_fp8(torch.randn(len(LENGTHS) * heads, head_dim), head_dim, use_ue8m0=True)
    q = q.view(len(LENGTHS), heads, head_dim)
    weights = torch.randn(len(LENGTHS), heads) * q_scale.view(len(LENGTHS), heads)
    lengths = torch.tensor(LENGTHS)
    mine = torch.empty(len(LENGTHS), topk, dtype=torch.int32)
    v32._score_rows(q, weights, keys, lengths, topk, mine)

    tables = table[None].expand(len(LENGTHS), -1).contiguous()
    logits = ops.fp8_paged_mqa_logits_cpu(q, cache.view(cache.shape[0], -1), weights, lengths.int(), tables, block,
                                          max(LENGTHS))
    own_logits = (torch.einsum("thd,sd->ths", q.float(), keys).relu() * weights[:, :, None]).sum(1)
    valid = torch.arange(max(LENGTHS))[None] < lengths[:, None]
    assert torch.allclose(logits[valid], own_logits[valid], rtol=1e-5, atol=1e-4)
    pages, positions = (torch.empty(len(LENGTHS), topk, dtype=torch.int32) for _ in range(2))
    ops.topk_transform_512_cpu(logits, lengths.int(), tables, pages, block, positions)

    data = torch.zeros(24, block, head_dim)  # the reference engine's layout: dequantized keys, unit scales
    data[table.long()] = torch.nn.functional.pad(keys, (0, 0, 0, -(-700 // block) * block - 700)).view(-1, block,
                                                                                                      head_dim)
    reference = torch.ops.kvpp_ref.indexer_topk(q, weights, data, torch.ones(24, block, 1), tables, lengths,
                                                torch.ones(len(LENGTHS), dtype=torch.int64), topk, 0)

    def sets(rows):
        return [sorted(row[row >= 0].tolist()) for row in rows]

    assert sets(mine) == sets(positions) == sets(reference)
    assert [len(s) for s in sets(mine)] == [min(n, topk) for n in LENGTHS]
    assert sets(mine)[-1] != list(range(topk))


def test_the_torch_sparse_attention_equals_the_reference_engines_sfa_attention():
    """Six tokens of two requests attend over their top-k positions of a paged latent cache: the stand-in impl's
    ``forward_mqa`` (through vLLM's XPU sparse MLA impl class) equals the reference engine's `kvpp_ref::mla_attention`
    with the same top-k indices, within float32 rounding. The control: one token's top-k changed changes its
    output and no other's."""
    torch.manual_seed(1)
    heads, block, topk = 4, 16, 8
    cache = torch.randn(12, block, 576)
    tables = torch.tensor([[3, 7, 1, 0, 9], [5, 2, 11, 4, 6]], dtype=torch.int32)
    requests = torch.tensor([0, 0, 0, 1, 1, 1])
    positions = torch.tensor([5, 40, 63, 2, 30, 77])  # each token's own position: it sees 0..position
    chosen = torch.full((6, topk), -1, dtype=torch.int32)
    for t, position in enumerate(positions.tolist()):
        picks = torch.randperm(position + 1)[:topk]
        chosen[t, : len(picks)] = picks.int()
    q = torch.randn(6, heads, 576)

    impl = object.__new__(v32.CPUSparseMLAImpl)
    impl.kv_lora_rank, impl.softmax_scale = 512, 0.07

    def stand_in(indices):
        impl.topk_indices_buffer = indices
        metadata = types.SimpleNamespace(topk_tokens=topk, req_id_per_token=requests.int(), block_table=tables)
        return impl.forward_mqa(q, cache, metadata, layer=None)[0]

    def reference(indices):
        return torch.ops.kvpp_ref.mla_attention(q[..., :512], q[..., 512:], cache, tables[requests].contiguous(),
                                                positions + 1, torch.ones(6, dtype=torch.int64), 0.07, 0,
                                                indices.long())

    assert torch.allclose(stand_in(chosen), reference(chosen), rtol=1e-5, atol=1e-5)
    other = chosen.clone()
    other[4] = torch.randperm(31)[:topk].int()
    changed = stand_in(other)
    assert not torch.allclose(changed[4], stand_in(chosen)[4], atol=1e-3)
    assert torch.equal(torch.cat([changed[:4], changed[5:]]), torch.cat([stand_in(chosen)[:4], stand_in(chosen)[5:]]))
    assert torch.allclose(changed, reference(other), rtol=1e-5, atol=1e-5)
