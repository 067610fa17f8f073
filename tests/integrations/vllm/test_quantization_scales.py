"""Under an fp8 KV cache, every rank of a KVPP group must hold the same q and k scales for each layer: a rank
reads the owner's cache bytes, and the owner descales every rank's quantized queries, with the owner's scales.
The allocation gathers them on the group's gloo agreement group and refuses a difference by name."""

from __future__ import annotations

import types
from datetime import timedelta

import torch

NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def layer(cache_dtype: str, q_scale: float = 1.0, k_scale: float = 1.0):
    """What the check reads of vLLM's MLAAttention: its cache dtype and its scale buffers."""
    return types.SimpleNamespace(kv_cache_dtype=cache_dtype, _q_scale=torch.tensor(q_scale),
                                 _k_scale=torch.tensor(k_scale))


def scale_ranks(rank: int, world: int, cache_dtype: str, skewed_rank: int | None) -> str:
    """Two layers with an fp8 (or bf16) cache; `skewed_rank` holds another q scale for layer 1."""
    import torch.distributed as dist

    from kvpp_fx.integrations.vllm.cache.allocation import check_scales, quantized_cache_scales
    from kvpp_fx.integrations.vllm.engine.state import KVPPAllocationError

    context = {NAMES[0]: layer(cache_dtype, 0.5, 0.25),
               NAMES[1]: layer(cache_dtype, 0.75 if rank == skewed_rank else 0.5, 0.25),
               "model.layers.0.self_attn.indexer.k_cache": types.SimpleNamespace()}  # no scales: not read
    runner = types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context=context))
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20), backend="gloo")
    scales = quantized_cache_scales(runner, {name: i for i, name in enumerate(context)})
    try:
        check_scales(scales, group, [0, 1])
    except KVPPAllocationError as exc:
        return f"refused: {exc}"
    return f"agreed: {sorted(scales.items())}"


def test_ranks_with_different_fp8_scales_are_refused_on_every_rank():
    """Equal scales pass (each layer's pair read); rank 1 holding another q scale for layer 1 is refused on both
    ranks, naming the layer and every rank's scales. A bf16 cache reads no scale, so a difference there (which
    no kernel uses) passes."""
    from tests.support.launch import launch

    agreed = launch(scale_ranks, 2, "fp8", None)
    assert agreed == [f"agreed: {[(NAMES[0], (0.5, 0.25)), (NAMES[1], (0.5, 0.25))]}"] * 2, agreed
    refused = launch(scale_ranks, 2, "fp8_e4m3", 1)
    for message in refused:
        assert message.startswith("refused: the ranks of KVPP group [0, 1] hold different quantization scales for "
                                  f"'{NAMES[1]}' ((q scale, k scale) by rank: [(0.5, 0.25), (0.75, 0.25)])"), message
    assert launch(scale_ranks, 2, "auto", 1) == ["agreed: []"] * 2
