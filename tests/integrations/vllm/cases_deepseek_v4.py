"""DeepSeek-V4's owner call on vLLM CPU's own kernels: what one call over every rank's heads relies on.

The owner runs vLLM's ``_prepare_and_attn`` once for all heads (`attention.deepseek_v4`): each rank's output is
bit-exact with its own call only because the fused query norm and RoPE and the sparse attention kernel treat
each head alone, given its sink. Run by `test_vllm_objects.py::test_against_vllm_objects`.
"""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM)

import torch

T, H, D, BLOCK, WINDOW = 5, 8, 512, 64, 4
PAGE = 37440  # 64 rows of 584 bytes (fp8_ds_mla), padded to 576 multiples


def _inputs():
    torch.manual_seed(0)
    q = torch.randn(T, H, D, dtype=torch.bfloat16)
    kv = torch.randn(T, D, dtype=torch.bfloat16)
    positions = torch.arange(T, dtype=torch.int64)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = torch.outer(torch.arange(16).float(), inv)
    return q, kv, positions, torch.cat([freqs.cos(), freqs.sin()], -1).contiguous()


def test_the_owner_call_over_all_heads_gives_each_rank_the_bits_of_its_own_call():
    from vllm import _custom_ops as ops
    from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu

    q, kv, positions, cos_sin = _inputs()
    cache = torch.zeros(2, PAGE, dtype=torch.uint8)
    no_slot = torch.full((T,), -1, dtype=torch.int64)
    all_heads = ops.fused_qnorm_rope_kv_insert_cpu(q, kv, positions, cache, positions.clone(), cos_sin, H, 1e-6,
                                                   BLOCK)
    assert int((cache != 0).sum()) > 0  # the owner's call wrote the window rows
    untouched = torch.zeros_like(cache)
    halves = [ops.fused_qnorm_rope_kv_insert_cpu(q[:, h].contiguous(), kv, positions, untouched, no_slot, cos_sin,
                                                 H // 2, 1e-6, BLOCK) for h in (slice(0, H // 2), slice(H // 2, H))]
    assert torch.equal(torch.cat(halves, 1), all_heads)
    assert int((untouched != 0).sum()) == 0  # slot -1 writes nothing

    local = (positions - WINDOW + 1).clamp(min=0).unsqueeze(-1) + torch.arange(WINDOW)
    local = torch.where(local <= positions.unsqueeze(-1), local, torch.full_like(local, -1))
    slots = map_local_to_global_slots_cpu(local, torch.zeros(T, dtype=torch.int32),
                                          torch.tensor([[0, 1]], dtype=torch.int32), BLOCK)
    sinks = torch.randn(H)

    def attend(queries, sink):
        out = torch.empty_like(queries)
        torch.ops._C.flash_mla_with_kvcache_cpu(out, queries, cache, slots, BLOCK, cache, slots.new_full((T, 0), -1),
                                                1, sink, D ** -0.5)
        return out

    owner = attend(all_heads, sinks)
    ranks = [attend(all_heads[:, h].contiguous(), sinks[h].contiguous())
             for h in (slice(0, H // 2), slice(H // 2, H))]
    assert torch.equal(torch.cat(ranks, 1), owner)
    # the control: an owner call with one rank's sinks for every head is not what the ranks compute
    wrong = attend(all_heads, torch.cat([sinks[:H // 2], sinks[:H // 2]]))
    assert not torch.equal(wrong[:, H // 2:], ranks[1])
