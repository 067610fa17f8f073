import json

import pytest

from kvpp_fx.cache.spec import ModelCacheSpec, PRESETS, UnknownModelError, load_hf_config


def test_mla_bf16_bytes_per_block():
    spec = ModelCacheSpec.from_hf_config(PRESETS["deepseek-v3"], block_size=128)
    assert len(spec.target_layers) == 61 and spec.draft_layers == ()
    assert spec.bytes_per_block(0) == (512 + 64) * 128 * 2


def test_mtp_layers_are_drafts():
    spec = ModelCacheSpec.from_hf_config(PRESETS["deepseek-v3"], include_mtp=True)
    assert spec.draft_layers == (61,)


def test_c8_adds_a_scale_per_token():
    spec = ModelCacheSpec.from_hf_config(PRESETS["kimi-k2"], block_size=128, kv_dtype="int8")
    assert [c.name for c in spec.layer(0).components] == ["kv", "kv_scale"]
    assert spec.bytes_per_block(0) == 576 * 128 + 4 * 128


def test_sfa_indexer_fp8_and_bf16():
    fp8 = ModelCacheSpec.from_hf_config(PRESETS["deepseek-v3.2-exp"], block_size=64)
    assert fp8.bytes_per_block(0) == 64 * (576 * 2 + 128 + 4)
    bf16 = ModelCacheSpec.from_hf_config(PRESETS["deepseek-v3.2-exp"], block_size=64, indexer_dtype="bf16")
    assert bf16.bytes_per_block(0) == 64 * (576 * 2 + 128 * 2)


def test_presets():
    assert PRESETS["deepseek-v2-lite"]["num_hidden_layers"] == 27
    assert PRESETS["deepseek-v2-lite"]["num_nextn_predict_layers"] == 0


def test_hf_config_path_and_errors(tmp_path):
    path = tmp_path / "m" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"num_hidden_layers": 3, "kv_lora_rank": 16, "qk_rope_head_dim": 8}))
    name, cfg = load_hf_config(str(path.parent))
    assert name == "m" and cfg["num_hidden_layers"] == 3
    with pytest.raises(UnknownModelError, match="unknown model"):
        load_hf_config(str(tmp_path / "missing"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UnknownModelError, match="cannot read"):
        load_hf_config(str(tmp_path / "bad.json"))
    with pytest.raises(UnknownModelError, match="not an MLA model config"):
        ModelCacheSpec.from_hf_config({"num_hidden_layers": 3})
    with pytest.raises(ValueError, match="kv_dtype"):
        ModelCacheSpec.from_hf_config(PRESETS["kimi-k2"], kv_dtype="fp4")
