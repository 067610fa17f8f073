"""DeepSeek-V4's caches per layer, their owners, and the capacity `kvpp-fx plan` prints for DeepSeek-V4-Flash."""

import itertools
import json

import pytest
import torch

from kvpp_fx.cache.layer_caches import (Cache, LayerCachesError, LayerCachesPlan, balanced_group_owners,
                                        deepseek_v4_caches, ideal_ratio)
from kvpp_fx.cache.placement import assign_owners
from kvpp_fx.cache.spec import PRESETS, ModelCacheSpec, UnknownModelError
from kvpp_fx.cli import main
from tests.integrations.vllm.tiny_model import TINY_DEEPSEEK_V4

FLASH = PRESETS["deepseek-v4-flash"]
TB = 1 << 40


def _vllm_spec(cache: Cache, kv_dtype: str):
    """vLLM 0.32's own spec of a cache, built as `vllm/models/deepseek_v4/` and `sparse_swa.py` build it."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    fp8 = kv_dtype == "fp8"
    common = {"block_size": cache.block_size, "num_kv_heads": 1, "max_tp_shards": 1,
              "alignment": 576 if fp8 else 512}
    if cache.name in ("compressed_kv", "window_kv"):
        kv = {"head_size": 512, "dtype": torch.uint8 if fp8 else torch.bfloat16,
              "cache_dtype_str": "fp8_ds_mla" if fp8 else "auto", "state_content_bytes": 584 if fp8 else None}
        if cache.name == "window_kv":
            return SlidingWindowMLASpec(sliding_window=cache.window, **kv, **common)
        return MLAAttentionSpec(tokens_per_state=cache.tokens_per_row, model_version="deepseek_v4", **kv, **common)
    if cache.name == "indexer_keys":
        return MLAAttentionSpec(head_size=132, dtype=torch.uint8, tokens_per_state=4, **common)
    return SlidingWindowMLASpec(head_size=cache.row_bytes // 4, dtype=torch.float32, sliding_window=cache.window,
                                **common)


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_every_page_is_the_one_vllm_allocates(kv_dtype):
    model = deepseek_v4_caches(FLASH, kv_dtype=kv_dtype, include_mtp=True)
    seen = set()
    for layer in model.layers:
        for cache in layer.caches:
            assert cache.page_bytes == _vllm_spec(cache, kv_dtype).page_size_bytes, (layer.index, cache.name)
            seen.add((layer.compress_ratio, cache.name))
    assert {name for _, name in seen} == {"window_kv", "compressed_kv", "compressor_state", "indexer_keys",
                                          "indexer_compressor_state"}
    # control: the same cache with a row per 2 tokens is not what vLLM allocates
    cache = model.layer(2).caches[1]
    halved = Cache(cache.name, cache.row_bytes, 2, cache.block_size, cache.page_alignment)
    assert halved.page_bytes != _vllm_spec(cache, kv_dtype).page_size_bytes


def test_deepseek_v4_flash_caches_per_layer():
    model = deepseek_v4_caches(FLASH)
    ratios = [model.layer(i).compress_ratio for i in model.target_layers]
    assert (len(ratios), ratios.count(0), ratios.count(4), ratios.count(128)) == (43, 2, 21, 20)
    assert [c.name for c in model.layer(0).caches] == ["window_kv"]
    assert [c.name for c in model.layer(3).caches] == ["window_kv", "compressed_kv", "compressor_state"]
    # ratio 4: 64 rows of 584 bytes padded to 576 multiples, and 64 indexer rows of 132 bytes, per 256 tokens
    assert model.layer(2).bytes_per_token == (37440 + 8640) / 256 == 180.0
    assert model.layer(3).bytes_per_token == 1728 / 256 == 6.75
    assert sum(layer.bytes_per_token for layer in model.layers) == 21 * 180 + 20 * 6.75 == 3915
    # the window keeps 127 tokens in at most 3 pages of 64; a ratio-128 compressor 127 tokens in 17 pages of 8
    assert model.layer(0).request_bytes(40) == 37440 and model.layer(0).request_bytes(1 << 20) == 3 * 37440
    assert model.layer(3).bounded_bytes == 3 * 37440 + 17 * 32832


def test_vllms_packed_groups_of_the_tiny_model_as_its_engine_forms_them():
    """The groups vLLM 0.32 forms for the tests' tiny V4 (read from its engine at TP 2): every growing cache in
    one, the window caches split by position in two, the two compressor-state kinds; and the blocks the engine
    test measures (`test_vllm_deepseek_v4.py`)."""
    plan = LayerCachesPlan(deepseek_v4_caches(TINY_DEEPSEEK_V4), 2)
    assert [sorted(group) for group in plan.groups] == [
        [(1, "compressed_kv"), (1, "indexer_keys"), (2, "compressed_kv"), (3, "compressed_kv"), (3, "indexer_keys")],
        [(0, "window_kv"), (2, "window_kv")], [(1, "window_kv"), (3, "window_kv")],
        [(1, "compressor_state"), (1, "indexer_compressor_state"), (3, "compressor_state"),
         (3, "indexer_compressor_state")], [(2, "compressor_state")]]
    assert plan.block_bytes() == 2 * 8640 + 2 * 37440 + 1728 == 93888
    assert [plan.block_bytes(r) for r in range(2)] == [8640 + 37440 + 1728, 8640 + 37440]
    assert [plan.owned_layers(r) for r in range(2)] == [(1, 2), (0, 3)]


def test_owners_make_the_largest_ranks_block_as_small_as_vllms_groups_allow():
    plan = LayerCachesPlan(deepseek_v4_caches(FLASH), 8)
    assert sorted(plan.owners) == list(range(43))
    ratio4 = [[i for i in plan.owned_layers(r) if plan.model.layer(i).compress_ratio == 4] for r in range(8)]
    assert sorted(len(layers) for layers in ratio4) == [2, 2, 2, 3, 3, 3, 3, 3]  # 21 over 8, at most 3 each
    # a rank with 3 ratio-4 layers (46,080 bytes of growing pages each) takes at most 3 ratio-128 ones (1,728);
    # the ratio-128 layers' windows sit in one window group (odd positions), 3 per rank at most elsewhere
    assert plan.block_bytes(plan.worst_rank) == 3 * 46080 + 3 * 1728 == 143424
    assert plan.block_bytes() == 21 * 46080 + 20 * 1728 == 1002240
    # the contiguous split would put 6 layers' windows on a rank
    contiguous = assign_owners(range(43), 8)
    assert max(plan._pages_per_group(tuple(i for i in contiguous if contiguous[i] == r))[1] for r in range(8)) \
        > plan.block_bytes(plan.worst_rank) - 3 * 46080


def _some_owners_fit(loads: dict[int, list[int]], ranks: int, limit: int) -> bool:
    """Whether any one-owner-per-layer assignment keeps every rank's block (its largest group) within `limit`:
    an exhaustive search over how many layers of each kind (equal pages per group) each rank takes."""
    kinds = {}
    for pages in loads.values():
        kinds[tuple(pages)] = kinds.get(tuple(pages), 0) + 1
    vectors, counts = list(kinds), list(kinds.values())

    def block(take):
        return max(sum(n * v[g] for n, v in zip(take, vectors)) for g in range(len(vectors[0])))

    one_rank = [t for t in itertools.product(*(range(c + 1) for c in counts)) if block(t) <= limit]
    reachable = {tuple(0 for _ in counts)}
    for _ in range(ranks):
        reachable = {tuple(a + b for a, b in zip(done, take)) for done in reachable for take in one_rank
                     if all(a + b <= c for a, b, c in zip(done, take, counts))}
    return tuple(counts) in reachable


def test_no_owners_give_deepseek_v4_flash_7x_at_tp8_in_vllms_packed_pool():
    """The 6.988x of the planner (without MTP) is the most one owner per layer can give under vLLM's packed pool: no
    assignment makes the busiest rank's block smaller than the planner's (searched exhaustively), and 7.0x would
    need 1,002,240 / 7 = 143,177 bytes."""
    plan = LayerCachesPlan(deepseek_v4_caches(FLASH), 8)
    loads = {i: plan._pages_per_group((i,)) for i in plan.model.target_layers}
    best = plan.block_bytes(plan.worst_rank)
    assert _some_owners_fit(loads, 8, best) and not _some_owners_fit(loads, 8, best - 1)
    assert plan.block_bytes() == 1_002_240 and plan.block_bytes() // 7 == 143_177 < best == 143_424
    # the search can answer yes: the tiny model's four layers over 2 ranks, at the planner's block and below it
    tiny = LayerCachesPlan(deepseek_v4_caches(TINY_DEEPSEEK_V4), 2)
    tiny_loads = {i: tiny._pages_per_group((i,)) for i in tiny.model.target_layers}
    tiny_best = tiny.block_bytes(tiny.worst_rank)
    assert _some_owners_fit(tiny_loads, 2, tiny_best) and not _some_owners_fit(tiny_loads, 2, tiny_best - 1)


def test_balanced_group_owners_balances_the_largest_group_and_ignores_input_order():
    loads = {0: [4, 0], 1: [4, 0], 2: [0, 3], 3: [1, 3], 4: [0, 1]}
    owners = balanced_group_owners(loads, 2)
    held = [[sum(loads[i][g] for i in loads if owners[i] == r) for g in range(2)] for r in range(2)]
    assert max(max(h) for h in held) == 5 and owners[0] != owners[1]
    assert balanced_group_owners(dict(reversed(loads.items())), 2) == owners
    assert balanced_group_owners(loads, 2, base=[10, 0]) == owners  # a base every rank holds changes nothing


def test_deepseek_v4_flash_at_tp8_plans_about_7x_the_blocks():
    """vLLM's packed pool: the ratio is the packed block over the largest rank's, at every context; requests
    per rank follow it. The growing caches set both blocks, so the bytes per context token give the same ratio."""
    plan = LayerCachesPlan(deepseek_v4_caches(FLASH), 8)
    assert plan.capacity_ratio == 1002240 / 143424
    assert 6.98 < plan.capacity_ratio < 7.0 and ideal_ratio(plan) == 3915 / (3 * 180 + 3 * 6.75)
    memory = 64 << 30
    for tokens in (131072, 1048576):
        per_request = plan.blocks_per_request(tokens)
        # 256-token blocks of the growing group, and each bounded group's pages: 2 window groups of 3 pages of
        # 64 tokens, 3 pages of 4 tokens of ratio-4 state, 17 pages of 8 tokens of ratio-128 state
        assert per_request == tokens // 256 + 2 * 3 + 3 + 17
        assert plan.requests(memory, tokens, kvpp=False) == memory // 1002240 // per_request
        assert plan.requests(memory, tokens) == memory // 143424 // per_request


def test_decode_reads_grow_with_the_context_and_owner_mode_does_not():
    plan = LayerCachesPlan(deepseek_v4_caches(FLASH), 8)
    short, long = plan.decode_read_bytes(131072), plan.decode_read_bytes(1048576)
    assert 100e6 < short < 120e6 and 7 * short < long
    # per layer and non-owner rank at TP 8: 8 heads' 512-wide bf16 queries out and outputs back
    assert plan.owner_exchange_bytes() == 2 * 8 * 512 * 2 == 16384
    with pytest.raises(LayerCachesError, match="do not split evenly"):
        LayerCachesPlan(deepseek_v4_caches(FLASH), 3).owner_exchange_bytes()


def test_the_mtp_layer_stays_on_every_rank():
    plan = LayerCachesPlan(deepseek_v4_caches(FLASH, include_mtp=True), 8)
    assert 43 not in plan.owners and all(43 in plan.held_layers(r) for r in range(8))


@pytest.mark.parametrize("change, needle", [
    ({"compress_ratios": None}, "compress_ratios"),
    ({"compress_ratios": [4] * 10}, "compress_ratios"),
    ({"compress_ratios": [0, 0] + [4, 64] * 21}, "compress_ratios"),
    ({"head_dim": None}, "head_dim"),
    ({"sliding_window": 0}, "sliding_window"),
])
def test_a_config_without_what_the_caches_need_is_refused_by_name(change, needle):
    with pytest.raises(LayerCachesError, match=needle):
        deepseek_v4_caches({**FLASH, **change})


def test_the_single_cache_spec_refuses_deepseek_v4_by_name():
    with pytest.raises(UnknownModelError, match="several caches"):
        ModelCacheSpec.from_hf_config(FLASH)


def test_plan_prints_deepseek_v4_flash_capacity_at_128k_and_1m(capsys):
    assert main(["plan", "--model", "deepseek-v4-flash", "--tp", "8", "--kv-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "ratio 4 21, ratio 128 20" in out and "capacity ratio (worst rank 0): 6.988x" in out
    assert out.count("one request of ") == 2 and "one request of 1M tokens: 4,122 blocks" in out
    for name in ("window_kv", "compressed_kv", "compressor_state", "indexer_keys", "indexer_compressor_state"):
        assert f"  {name} " in out
    assert "16.00 KiB per layer and non-owner rank" in out


def test_plan_json_for_deepseek_v4(capsys):
    assert main(["plan", "--model", "deepseek-v4-flash", "--tp", "8", "--kv-memory", "64GiB", "--mtp",
                 "--max-model-len", "65536", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft_layers"] == [43] and report["capacity_ratio"] < 7.0
    assert [c["context_tokens"] for c in report["contexts"]] == [65536, 131072, 1048576]
    at = report["contexts"][1]
    assert at["kvpp_requests"] == report["engine_blocks"] // at["blocks_per_request"]
    assert report["engine_blocks"] == report["kv_memory_bytes"] // max(r["block_bytes"] for r in report["ranks"])
    # the MTP layer (ratio 0) adds a window cache and no compressed one
    assert (at["caches"]["compressed_kv"]["layers"], at["caches"]["window_kv"]["layers"]) == (41, 44)
    assert sum(r["bytes_per_token"] for r in report["ranks"]) == report["replicated_bytes_per_token"]


@pytest.mark.parametrize("args, needle", [
    (["--depth", "3"], "--depth: not used for deepseek_v4"),
    (["--block-size", "64"], "--block-size"),
    (["--pcp", "2"], "--pcp"),
    (["--context-tokens", "1000"], "--context-tokens"),
    (["--kv-dtype", "int8"], "--kv-dtype int8"),
])
def test_plan_refuses_what_deepseek_v4_has_no_use_for(capsys, args, needle):
    assert main(["plan", "--model", "deepseek-v4-flash", "--tp", "8", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1
