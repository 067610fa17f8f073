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


def test_the_block_zeroer_on_cpu_stores_what_vllms_kernel_stores():
    """`deepseek_v4_on_cpu.zero_block_ids`, which the V4 engines zero their new blocks with, against vLLM's
    ``_zero_kv_blocks_kernel`` (interpreted) on the same segments: a page shorter than its block stride, and
    two segments of one cache (a block's two rows) whose pages span two of the kernel's chunks of 1,024. The
    control: the same segments with the first page one value short leave that value."""
    from vllm.v1.worker.utils import KVBlockZeroer

    from tests.integrations.vllm.deepseek_v4_on_cpu import zero_block_ids

    kernel = KVBlockZeroer.zero_block_ids
    assert kernel is not zero_block_ids  # vLLM's own: this process never applied the engine's changes
    blocks, pages = [1, 4], [250, 1500, 1500]

    def zeroed(zero, page_sizes):
        caches = [torch.full((6, 300), 7, dtype=torch.int32), torch.full((6, 2, 1500), 7, dtype=torch.int32)]
        zeroer = object.__new__(KVBlockZeroer)
        zeroer.device = torch.device("cpu")
        addresses = [caches[0].data_ptr(), caches[1].data_ptr(), caches[1][0, 1].data_ptr()]
        zeroer._meta = (torch.tensor(addresses, dtype=torch.uint64), torch.tensor([300, 3000, 3000]),
                        torch.tensor(page_sizes), 2, 1024, 3)
        zero(zeroer, blocks)
        return caches

    expected = [torch.full((6, 300), 7, dtype=torch.int32), torch.full((6, 2, 1500), 7, dtype=torch.int32)]
    expected[0][blocks, :250] = 0
    expected[1][blocks] = 0
    by_kernel = zeroed(kernel, pages)
    assert all(torch.equal(a, b) for a, b in zip(by_kernel, expected))
    assert all(torch.equal(a, b) for a, b in zip(zeroed(zero_block_ids, pages), by_kernel))
    short = zeroed(zero_block_ids, [249, 1500, 1500])
    assert int((short[0] != by_kernel[0]).sum()) == len(blocks) and torch.equal(short[1], by_kernel[1])
