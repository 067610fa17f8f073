"""DeepSeek-V4's caches per layer, their owners, and the capacity `kvpp-fx plan` prints for DeepSeek-V4-Flash."""

import json

import pytest
import torch

from kvpp_fx.cache.layer_caches import (Cache, LayerCachesError, LayerCachesPlan, balanced_owners, deepseek_v4_caches,
                                        ideal_ratio)
from kvpp_fx.cache.placement import assign_owners
from kvpp_fx.cache.spec import PRESETS, ModelCacheSpec, UnknownModelError
from kvpp_fx.cli import main

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


def test_owners_balance_the_bytes_of_a_request():
    plan = LayerCachesPlan(deepseek_v4_caches(FLASH), 8)
    assert sorted(plan.owners) == list(range(43))
    ratio4 = [[i for i in plan.owned_layers(r) if plan.model.layer(i).compress_ratio == 4] for r in range(8)]
    assert sorted(len(layers) for layers in ratio4) == [2, 2, 2, 3, 3, 3, 3, 3]  # 21 over 8, at most 3 each
    worst = max(sum(plan.model.layer(i).bytes_per_token for i in plan.owned_layers(r)) for r in range(8))
    assert worst == 3 * 180
    assert ideal_ratio(plan) == 3915 / 540
    # the contiguous split of assign_owners would give rank 0 layers 0-5 (three ratio-4 layers), but also a
    # rank with four: 6 layers hold 3 of ratio 4 wherever they start on an even index
    contiguous = assign_owners(range(43), 8)
    held = [sum(plan.model.layer(i).bytes_per_token for i in contiguous if contiguous[i] == r) for r in range(8)]
    assert max(held) > worst


def test_balanced_owners_keeps_the_contiguous_split_for_equal_layers_and_ignores_input_order():
    assert balanced_owners(dict.fromkeys(range(10), 5), 4) == assign_owners(range(10), 4)
    weights = {0: 1, 1: 9, 2: 4, 3: 4, 4: 1}
    # heaviest first, each to the rank holding least: 9 -> 0, 4 -> 1, 4 -> 2, then the 1s to ranks 1 and 2
    assert balanced_owners(weights, 3) == {1: 0, 2: 1, 3: 2, 0: 1, 4: 2}
    assert balanced_owners(dict(reversed(weights.items())), 3) == balanced_owners(weights, 3)


@pytest.mark.parametrize("tokens", [131072, 1048576])
def test_deepseek_v4_flash_at_tp8_holds_over_7x_the_requests(tokens):
    plan = LayerCachesPlan(deepseek_v4_caches(FLASH), 8)
    ratio = plan.capacity_ratio(tokens)
    assert ratio >= 7.0
    # the ratio is the bytes of one request, replicated over the worst rank's: count them by hand
    model = plan.model
    replicated = sum(layer.request_bytes(tokens) for layer in model.layers)
    worst = max(sum(model.layer(i).request_bytes(tokens) for i in plan.owned_layers(r)) for r in range(8))
    assert ratio == replicated / worst
    assert plan.request_bytes(tokens, 0) < plan.request_bytes(tokens) / 7


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
    assert "ratio 4 21, ratio 128 20" in out and out.count("capacity ratio 7.") == 2
    for name in ("window_kv", "compressed_kv", "compressor_state", "indexer_keys", "indexer_compressor_state"):
        assert f"  {name} " in out
    assert "16.00 KiB per layer and non-owner rank" in out


def test_plan_json_for_deepseek_v4(capsys):
    assert main(["plan", "--model", "deepseek-v4-flash", "--tp", "8", "--kv-memory", "64GiB", "--mtp",
                 "--max-model-len", "65536", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft_layers"] == [43] and report["reference_tokens"] == 65536
    assert [c["context_tokens"] for c in report["contexts"]] == [65536, 131072, 1048576]
    at = report["contexts"][1]
    assert at["kvpp_requests"] == report["kv_memory_bytes"] // at["worst_rank_request_bytes"]
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
