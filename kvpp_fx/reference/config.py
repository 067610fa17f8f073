"""Configuration of the reference DeepSeek-V3-style model, its presets, and its cache spec."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpp_fx.cache.cost import AttentionShape
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec


class UnsupportedModelConfigError(ValueError):
    """The config asks for something the reference model does not implement."""


@dataclass(frozen=True)
class RefConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    first_k_dense_replace: int | None = None
    num_nextn_predict_layers: int = 0
    # SFA (DeepSeek-V3.2 lightning indexer); index_topk None means plain MLA.
    index_topk: int | None = None
    index_head_dim: int = 16
    index_n_heads: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.first_k_dense_replace is not None and self.first_k_dense_replace < self.num_hidden_layers:
            raise UnsupportedModelConfigError(
                f"the reference model has dense MLPs only: first_k_dense_replace ({self.first_k_dense_replace}) "
                f"must be >= num_hidden_layers ({self.num_hidden_layers}); MoE layers are served by vLLM's "
                "DeepSeek model.")
        if self.attention_bias:
            raise UnsupportedModelConfigError("the reference model does not implement attention_bias=True.")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in ("default", "yarn"):
            raise UnsupportedModelConfigError(f"rope_type {rope_type!r} is not supported (default or yarn).")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_sfa(self) -> bool:
        return self.index_topk is not None

    @property
    def draft_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers))

    def replace(self, **changes: Any) -> RefConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> RefConfig:
        """From a HuggingFace DeepSeek-V3 ``config.json`` dict (new ``rope_parameters`` or legacy keys)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in hf.items() if k in names and k != "rope_parameters"}
        rope = dict(hf.get("rope_parameters") or {})
        if not rope:
            rope = dict(hf.get("rope_scaling") or {})
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
            rope.setdefault("rope_type", "default")
            rope["rope_theta"] = float(hf.get("rope_theta", 10000.0))
        values["rope_parameters"] = rope
        moe = hf.get("n_routed_experts")
        if moe and values.get("first_k_dense_replace") is None:
            values["first_k_dense_replace"] = 0
        return cls(**values)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> RefConfig:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    def attention_shape(self, itemsize: int = 4) -> AttentionShape:
        """What owner mode ships per head and query token: the absorbed query ``[q_latent | q_pe]`` in,
        the attention-weighted latent out (fp32 activations by default)."""
        return AttentionShape(self.num_attention_heads, self.latent_width, self.kv_lora_rank, itemsize)

    def cache_spec(self, block_size: int, dtype: str = "float32") -> ModelCacheSpec:
        """The per-layer cache bundles: latent (+ indexer keys and scales for SFA); MTP layers are drafts."""
        comps = [ComponentSpec("kv", dtype, (self.latent_width,))]
        if self.is_sfa:
            comps += [ComponentSpec("indexer", "int8", (self.index_head_dim,)),
                      ComponentSpec("indexer_scale", "float32", (1,))]
        layers = [LayerCacheSpec(i, tuple(comps)) for i in range(self.num_hidden_layers)]
        layers += [LayerCacheSpec(i, tuple(comps[:1]), is_draft=True) for i in self.draft_layers]
        return ModelCacheSpec("reference", block_size, tuple(layers))


PRESETS: dict[str, RefConfig] = {
    "tiny": RefConfig(),
    "small": RefConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                       num_attention_heads=8, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                       qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=2048),
    "tiny-sfa": RefConfig(index_topk=24, index_head_dim=16, index_n_heads=4),
    "tiny-mtp": RefConfig(num_nextn_predict_layers=1),
}


def load_config(model: str | Path) -> RefConfig:
    """A preset name or a HuggingFace model directory."""
    if isinstance(model, str) and model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if (path / "config.json").is_file():
        return RefConfig.from_pretrained(path)
    raise UnsupportedModelConfigError(
        f"unknown reference model {str(model)!r}: not a preset ({', '.join(PRESETS)}) and no config.json there.")
