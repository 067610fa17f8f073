"""Per-layer KV cache components and their bytes per block (plain Python, no torch).

A layer's cache is a bundle of components (the MLA latent cache, its scale for C8, the SFA indexer
keys and their scale). Every component stores one fixed-shape record per token, so its size is
``prod(per_token) * itemsize * block_size`` bytes per block.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpp_fx.cache.cost import AttentionShape

DTYPE_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "int8": 1,
    "uint8": 1,
}

KV_DTYPES = ("bf16", "fp8", "int8")
INDEXER_DTYPES = ("fp8", "bf16")

# Bytes per value of the queries and outputs owner mode ships (activations, whatever the KV dtype).
QUERY_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}

# HuggingFace config.json fields of the shipped presets (only what the cache and owner mode depend on).
PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "num_nextn_predict_layers": 0,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "num_nextn_predict_layers": 1,
    },
    "deepseek-v3.2-exp": {
        "model_type": "deepseek_v32", "num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "num_nextn_predict_layers": 1,
        "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    },
    "kimi-k2": {
        "model_type": "kimi_k2", "num_hidden_layers": 61, "num_attention_heads": 64, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "num_nextn_predict_layers": 0,
    },
    # 43 layers: two window-only, then compress ratio 4 and 128 alternating (21 and 20); the 44th ratio is the
    # MTP layer's. Its caches are `kvpp_fx.cache.layer_caches`'.
    "deepseek-v4-flash": {
        "model_type": "deepseek_v4", "num_hidden_layers": 43, "num_attention_heads": 64, "head_dim": 512,
        "qk_rope_head_dim": 64, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
        "sliding_window": 128, "num_nextn_predict_layers": 1, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    },
}

# Models whose layers hold several caches of different shapes (`kvpp_fx.cache.layer_caches`).
LAYER_CACHES_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")


class UnknownModelError(ValueError):
    """The model is neither a shipped preset nor a readable HuggingFace config.json."""


class AttentionGeometryError(ValueError):
    """The config lacks what owner-mode bytes depend on (the head count, or the MLA widths)."""


@dataclass(frozen=True)
class ComponentSpec:
    """One cache component: a fixed-shape record of `dtype` per token."""

    name: str
    dtype: str
    per_token: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unsupported cache dtype {self.dtype!r}.")
        if not self.per_token or any(d < 1 for d in self.per_token):
            raise ValueError(f"component {self.name!r} needs a positive per-token shape.")

    @property
    def bytes_per_token(self) -> int:
        return math.prod(self.per_token) * DTYPE_ITEMSIZE[self.dtype]

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


@dataclass(frozen=True)
class LayerCacheSpec:
    """The cache bundle of one layer: its index, its components and whether it is a draft layer."""

    index: int
    components: tuple[ComponentSpec, ...]
    is_draft: bool = False

    @property
    def bytes_per_token(self) -> int:
        return sum(c.bytes_per_token for c in self.components)

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def component(self, name: str) -> ComponentSpec:
        for comp in self.components:
            if comp.name == name:
                return comp
        raise KeyError(f"layer {self.index} has no cache component {name!r}.")


@dataclass(frozen=True)
class ModelCacheSpec:
    """The cache layout of a whole model: every layer's bundle, plus the block size."""

    name: str
    block_size: int
    layers: tuple[LayerCacheSpec, ...]

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}.")
        indices = [layer.index for layer in self.layers]
        if len(set(indices)) != len(indices):
            raise ValueError("layer indices must be unique.")

    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if not layer.is_draft)

    @property
    def draft_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.is_draft)

    def layer(self, index: int) -> LayerCacheSpec:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise KeyError(f"model {self.name!r} has no layer {index}.")

    def bytes_per_block(self, index: int) -> int:
        return self.layer(index).bytes_per_block(self.block_size)

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any],
        *,
        name: str | None = None,
        block_size: int = 128,
        kv_dtype: str = "bf16",
        indexer_dtype: str = "fp8",
        include_mtp: bool = False,
    ) -> ModelCacheSpec:
        """Build the cache spec from a HuggingFace DeepSeek-style ``config.json`` mapping."""
        if config.get("model_type") in LAYER_CACHES_MODEL_TYPES:
            raise UnknownModelError(
                f"{config['model_type']} layers hold several caches of different shapes: "
                "kvpp_fx.cache.layer_caches.deepseek_v4_caches describes them.")
        try:
            num_layers = int(config["num_hidden_layers"])
            kv_lora_rank = int(config["kv_lora_rank"])
            rope = int(config["qk_rope_head_dim"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UnknownModelError(
                f"config is not an MLA model config (missing or bad {exc}): needs "
                "num_hidden_layers, kv_lora_rank and qk_rope_head_dim."
            ) from None
        components = list(main_cache_components(kv_lora_rank, rope, kv_dtype))
        if config.get("index_topk"):
            components.extend(indexer_cache_components(int(config["index_head_dim"]), indexer_dtype))
        layers = [LayerCacheSpec(i, tuple(components)) for i in range(num_layers)]
        if include_mtp:
            nextn = int(config.get("num_nextn_predict_layers") or 0)
            layers += [
                LayerCacheSpec(num_layers + j, tuple(components), is_draft=True) for j in range(nextn)
            ]
        return cls(name or str(config.get("model_type", "model")), block_size, tuple(layers))


def attention_shape_from_hf_config(config: Mapping[str, Any], query_dtype: str = "bf16") -> AttentionShape:
    """What owner mode ships per head and query token of an absorbed-MLA model.

    A head's query is ``kv_lora_rank + qk_rope_head_dim`` values and its output ``kv_lora_rank`` values,
    of the activation dtype. Under an fp8 KV cache vLLM's FLASHMLA, FLASHINFER_MLA and CUTLASS_MLA quantize
    the queries to one byte per value before the exchange: counted here at the activation dtype, these
    bytes bound theirs from above.
    """
    if query_dtype not in QUERY_DTYPES:
        raise ValueError(f"query dtype must be one of {tuple(QUERY_DTYPES)}, got {query_dtype!r}.")
    fields = {}
    for name in ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim"):
        value = config.get(name)
        if value is None:
            raise AttentionGeometryError(
                f"config has no {name}: owner-mode bytes need num_attention_heads, kv_lora_rank and "
                "qk_rope_head_dim.")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AttentionGeometryError(f"config's {name} must be a positive integer, got {value!r}.")
        fields[name] = value
    return AttentionShape(num_heads=fields["num_attention_heads"],
                          q_width=fields["kv_lora_rank"] + fields["qk_rope_head_dim"],
                          out_width=fields["kv_lora_rank"], itemsize=QUERY_DTYPES[query_dtype])


def main_cache_components(kv_lora_rank: int, rope: int, kv_dtype: str) -> tuple[ComponentSpec, ...]:
    """The MLA latent cache: bf16, fp8, or C8 (int8 data plus an fp32 scale per token)."""
    width = kv_lora_rank + rope
    if kv_dtype == "bf16":
        return (ComponentSpec("kv", "bfloat16", (width,)),)
    if kv_dtype == "fp8":
        return (ComponentSpec("kv", "float8_e4m3fn", (width,)),)
    if kv_dtype == "int8":
        return (ComponentSpec("kv", "int8", (width,)), ComponentSpec("kv_scale", "float32", (1,)))
    raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}.")


def indexer_cache_components(index_head_dim: int, dtype: str = "fp8") -> tuple[ComponentSpec, ...]:
    """The SFA lightning-indexer key cache: fp8 keys plus an fp32 scale per token, or bf16 keys."""
    if dtype == "fp8":
        return (
            ComponentSpec("indexer", "float8_e4m3fn", (index_head_dim,)),
            ComponentSpec("indexer_scale", "float32", (1,)),
        )
    if dtype == "bf16":
        return (ComponentSpec("indexer", "bfloat16", (index_head_dim,)),)
    raise ValueError(f"indexer dtype must be one of {INDEXER_DTYPES}, got {dtype!r}.")


def load_hf_config(model: str) -> tuple[str, dict[str, Any]]:
    """A preset name, a ``config.json`` path, or a directory holding one -> (name, config dict)."""
    if model in PRESETS:
        return model, dict(PRESETS[model])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UnknownModelError(
            f"unknown model {model!r}: not a preset ({', '.join(sorted(PRESETS))}) "
            "and not a config.json path."
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnknownModelError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise UnknownModelError(f"{path} does not hold a JSON object.")
    return path.parent.name or str(path), config
