"""Weights of the reference model: seeded random init, HuggingFace safetensors, and TP sharding.

Every rank builds the same full state dict (same seed or same checkpoint) and keeps its shard, so a
TP run computes what a TP 1 run computes, up to the order of the all-reduce sums.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvpp_fx.reference.config import RefConfig
from kvpp_fx.reference.model import PPInfo, ReferenceModel, TPInfo

# Output-dim (rows) sharded: column parallel; input-dim (cols) sharded: row parallel.
ROW_SHARDED = ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight")
COL_SHARDED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors do not fit the reference model."""


def random_state_dict(config: RefConfig) -> dict[str, torch.Tensor]:
    """The full (TP 1) weights, deterministic in ``config.seed``. Norm weights are perturbed around 1."""
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        model = ReferenceModel(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name or "k_norm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
                elif name.endswith("embed_tokens.weight"):
                    param.normal_(0.0, 1.0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard(name: str, tensor: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    if tp.size == 1:
        return tensor
    if name.endswith(ROW_SHARDED):
        return tensor.chunk(tp.size, dim=0)[tp.rank].contiguous()
    if name.endswith(COL_SHARDED):
        return tensor.chunk(tp.size, dim=1)[tp.rank].contiguous()
    return tensor


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointMismatchError(f"no safetensors files in {path}.")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def build_model(config: RefConfig, tp: TPInfo | None = None, checkpoint: str | Path | None = None,
                dtype: torch.dtype = torch.float32, pp: PPInfo | None = None) -> ReferenceModel:
    """A reference model holding this rank's shard of the seeded or checkpoint weights."""
    tp = tp or TPInfo()
    full = random_state_dict(config)
    if checkpoint is not None:
        loaded = read_safetensors_dir(checkpoint)
        if config.tie_word_embeddings and "lm_head.weight" not in loaded:
            loaded["lm_head.weight"] = loaded["model.embed_tokens.weight"]
        unexpected = sorted(set(loaded) - set(full))
        if unexpected:
            raise CheckpointMismatchError(f"checkpoint tensors the reference model does not have: {unexpected[:5]}")
        for name, tensor in loaded.items():
            if tensor.shape != full[name].shape:
                raise CheckpointMismatchError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, model shape {tuple(full[name].shape)}.")
            full[name] = tensor
        missing = [n for n in full if n not in loaded and not _is_draft(n, config)]
        if missing:
            raise CheckpointMismatchError(f"checkpoint lacks {missing[:5]}")
    model = ReferenceModel(config, tp, pp)
    model.load_state_dict({name: shard(name, t, tp).to(dtype) for name, t in full.items()}, strict=True)
    return model.to(dtype).eval()


def _is_draft(name: str, config: RefConfig) -> bool:
    return any(name.startswith(f"model.layers.{i}.") for i in config.draft_layers)
