"""The reference model loads a HuggingFace DeepseekV3ForCausalLM checkpoint and matches its logits."""

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from kvpp_fx.reference.config import RefConfig, UnsupportedModelConfigError
from kvpp_fx.reference.engine import EngineConfig
from kvpp_fx.reference.generate import rank_groups, run_engine
from tests.support.launch import launch

DECODE_STEPS = 8


def step_logits(rank: int, world: int, checkpoint: str, prompt: list[int], decode_steps: int):
    """Rank function: logits of the prompt's last token, then of each greedy decode step (reads the paged
    cache)."""
    config = RefConfig.from_pretrained(checkpoint)
    engine_config = EngineConfig(graph_mode="none", token_budget=256)
    with torch.no_grad():
        run = run_engine(config, [prompt], decode_steps + 1, engine_config=engine_config,
                         groups=rank_groups(rank, world), kvpp=False, num_blocks=16, checkpoint=checkpoint,
                         keep_logits=True)
    return {"logits": torch.stack([torch.from_numpy(step[0]) for step in run["logits"]]), "tokens": run["outputs"][0]}


def hf_config(q_lora_rank):
    return DeepseekV3Config(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=3, max_position_embeddings=256,
        initializer_range=0.1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})


@pytest.fixture(scope="module", params=[None, 24], ids=["q_proj", "q_lora"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(hf_config(request.param)).eval()
    path = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(path)
    return str(path), model


def hf_step_logits(model, prompt, tokens):
    """HF logits for the prompt, then for each of our tokens fed one at a time through its own cache."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, past = [out.logits[0, -1]], out.past_key_values
        for token in tokens[:-1]:
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            logits.append(out.logits[0, -1])
            past = out.past_key_values
    return torch.stack(logits)


PROMPT = list(range(3, 43))


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.multirank)])
def test_logits_match_huggingface(checkpoint, tp):
    path, hf = checkpoint
    if tp == 1:
        results = [step_logits(0, 1, path, PROMPT, DECODE_STEPS)]
    else:
        results = launch(step_logits, tp, path, PROMPT, DECODE_STEPS)
    for res in results:
        assert len(res["logits"]) == DECODE_STEPS + 1
        expected = hf_step_logits(hf, PROMPT, res["tokens"])
        torch.testing.assert_close(res["logits"], expected, rtol=1e-4, atol=1e-4)
        assert res["tokens"] == expected.argmax(-1).tolist()


def test_moe_configs_are_refused_clearly():
    with pytest.raises(UnsupportedModelConfigError,
                       match=r"first_k_dense_replace \(3\) must be >= num_hidden_layers \(61\)"):
        RefConfig.from_hf_config({"num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256})
    with pytest.raises(UnsupportedModelConfigError, match="rope_type 'longrope'"):
        RefConfig(rope_parameters={"rope_type": "longrope"})


def test_legacy_rope_keys_are_read():
    cfg = RefConfig.from_hf_config({"rope_theta": 5000.0, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                    "original_max_position_embeddings": 128}})
    assert cfg.rope_parameters == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                                   "rope_theta": 5000.0}
