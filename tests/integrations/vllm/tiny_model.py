"""A tiny random DeepSeek-V3 checkpoint that vLLM's CPU MLA can run, with one MTP layer and a tokenizer.

vLLM's CPU MLA needs the 512/64 latent; layers 0-3 are dense, 4-5 MoE. The MTP layer (index 6) is a
seventh HF decoder layer plus DeepSeek's MTP weights (enorm, hnorm, eh_proj, shared head). The
tokenizer is a small byte-level BPE trained here on a fixed text, so nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

NUM_LAYERS = 6
VOCAB = 512
TEXT = """KV layer parallelism keeps each layer's latent cache on one rank of the tensor parallel group.
The other ranks receive that layer by a broadcast into a scratch buffer just before attention reads it.
The next layer's broadcast is prefetched while the current layer computes. The scheduler does not change:
block tables, slot mappings and block ids stay as they are; only where the bytes live changes.
Once upon a time a small model answered questions about caches, layers, ranks and broadcasts."""


def make_tiny_deepseek(path: Path, num_layers: int = NUM_LAYERS, max_positions: int = 1024,
                       moe_layers: int = 2) -> str:
    """The checkpoint at `path` (``num_layers`` target layers, the last `moe_layers` MoE, plus one MTP
    layer), for contexts of up to `max_positions` tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=num_layers + 1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        first_k_dense_replace=num_layers - moe_layers,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=max_positions,
        initializer_range=0.3, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    mtp = f"model.layers.{num_layers}"
    hidden = config.hidden_size
    weights.update({
        f"{mtp}.enorm.weight": torch.ones(hidden), f"{mtp}.hnorm.weight": torch.ones(hidden),
        f"{mtp}.eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.05,
        f"{mtp}.shared_head.norm.weight": torch.ones(hidden),
        f"{mtp}.shared_head.head.weight": weights["lm_head.weight"].clone(),
        f"{mtp}.embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
    })
    save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    hf.update(num_hidden_layers=num_layers, num_nextn_predict_layers=1, topk_method="noaux_tc",
              scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(hf))
    _write_tokenizer(path)
    return str(path)


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT.splitlines(), trainer)
    # every id the model can emit decodes to text, so that equal texts mean equal tokens
    tokenizer.add_tokens([f"<t{i}>" for i in range(tokenizer.get_vocab_size(), VOCAB)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


# A tiny DeepSeek-V4 configuration (vLLM 0.32's `deepseek_v4` model type): a window-only layer, ratio-4
# layers (with the indexer) and a ratio-128 layer, with vLLM CPU's 512/64 latent, and its MTP layer (window only).
# vLLM CPU's expert top-k kernels take 64 or 256 experts, 6 or 8 per token. Config only: vLLM's dummy loader,
# widened (`deepseek_v4_on_cpu`), gives the weights.
TINY_DEEPSEEK_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_hidden_layers": 4,
    "compress_ratios": [0, 4, 128, 4, 0], "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 64, "o_lora_rank": 64, "o_groups": 2,
    "index_n_heads": 4, "index_head_dim": 128, "index_topk": 512, "sliding_window": 128, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "moe_intermediate_size": 64, "n_shared_experts": 1, "num_hash_layers": 1,
    "hc_mult": 4, "hc_sinkhorn_iters": 2, "hc_eps": 1e-6, "swiglu_limit": 10.0, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "topk_method": "noaux_tc", "vocab_size": VOCAB,
    "max_position_embeddings": 4096, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 256,
                     "type": "yarn"},
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}


def make_tiny_deepseek_v4_config(path: Path, max_positions: int | None = None, tokenizer: bool = False) -> str:
    """A directory holding `TINY_DEEPSEEK_V4` as its config.json (`max_positions`: its context, if longer), and the
    tiny tokenizer if asked (what vLLM's OpenAI server and benchmark client need)."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_DEEPSEEK_V4)
    if max_positions is not None:
        config["max_position_embeddings"] = max(max_positions, config["max_position_embeddings"])
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        _write_tokenizer(path)
    return str(path)


# A tiny DeepSeek-V3.2 (MLA with sparse attention: a lightning indexer selects 512 context positions per token),
# loaded with vLLM's dummy weights as `deepseek_v32_on_cpu` widens them; dense layers.
TINY_DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "num_hidden_layers": 2,
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "first_k_dense_replace": 2,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 4, "index_head_dim": 128,
    "index_topk": 512, "vocab_size": VOCAB, "max_position_embeddings": 2048, "rope_theta": 10000,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
}


def make_tiny_deepseek_v32_config(path: Path, max_positions: int | None = None) -> str:
    """A directory holding `TINY_DEEPSEEK_V32` as its config.json (`max_positions`: its context, if longer)."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_DEEPSEEK_V32)
    if max_positions is not None:
        config["max_position_embeddings"] = max(max_positions, config["max_position_embeddings"])
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
