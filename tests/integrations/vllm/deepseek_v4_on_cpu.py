"""Test-only: vLLM 0.32's DeepSeek-V4 on vLLM CPU, with random weights that move the logits.

Two changes, applied in every process of an engine whose environment sets `ENV` (the TP workers are spawned
and re-run the entry module, which imports this one):

- vLLM 0.32's CPU window-cache metadata builder (``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler``)
  returns the tile schedulers of 3 layer types, where ``DeepseekSparseSWAMetadataBuilder.build`` reads all five
  (``KeyError: 'c1a'``, a vLLM bug): it returns every layer type's, and CPU attention reads none of them;
- vLLM's dummy weights are uniform +-1e-3 (which leaves the logits nearly flat) from one seed for every weight,
  so every layer gets the same values and every TP rank the same shard: each rank's heads would equal the
  other's, and no test could tell one rank's heads from another's. Here they are uniform +-`SCALE`, seeded
  by the module's place in the model, plus the TP rank for what TP splits by head (column- and row-parallel
  linear layers, the attention sinks); replicated weights stay equal on every rank, and norm weights are
  about 1. Engines with KVPP on and off
  load the same weights.

The engine also needs Triton's interpreter (`triton_interpreter`): V4's metadata builders launch Triton
kernels.
"""

from __future__ import annotations

import os

ENV = "KVPP_TESTS_DEEPSEEK_V4"
SCALE = 0.1
_APPLIED = "_kvpp_tests_deepseek_v4"


def apply() -> None:
    import vllm.model_executor.model_loader.dummy_loader as dummy_loader
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa

    builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    if getattr(builder, _APPLIED, False):
        return
    layer_types = (sparse_swa._LAYER_TYPE_SWAONLY, sparse_swa._LAYER_TYPE_C4A, sparse_swa._LAYER_TYPE_C128A,
                   sparse_swa._LAYER_TYPE_C1A, sparse_swa._LAYER_TYPE_C2A)
    own = builder.build_tile_scheduler

    def build_tile_scheduler(self, *args, **kwargs):
        schedulers = own(self, *args, **kwargs)
        return {kind: schedulers.get(kind) for kind in layer_types}

    builder.build_tile_scheduler = build_tile_scheduler
    dummy_loader.DummyModelLoader.load_weights = load_weights
    setattr(builder, _APPLIED, True)


def load_weights(self, model, model_config) -> None:
    """vLLM's ``DummyModelLoader.load_weights`` with the seeds and range of the module docstring."""
    import vllm.model_executor.model_loader.dummy_loader as dummy_loader
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    rank = get_tensor_model_parallel_rank()
    for index, layer in enumerate(model.modules()):
        info = dummy_loader.get_layerwise_info(layer)
        if info.can_load():  # layers quantized online: vLLM's own (none in the tiny model)
            self._process_online_quant_layer(layer, info)
            continue
        # ReplicatedLinear reports the TP size too, so its class says what is split
        split = isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) and layer.tp_size > 1
        for name, tensor in dummy_loader.get_layer_tensors(layer).items():
            if name in layer._non_persistent_buffers_set:
                continue
            by_rank = split or name == "attn_sink"
            # a norm's weight about 1, as trained ones are: about +-SCALE, it would shrink what it normalizes
            low = 1.0 - SCALE if isinstance(layer, RMSNorm) or name.endswith("norm_weight") else -SCALE
            seed = 1234 + index + 7919 * rank * by_rank
            dummy_loader.initialize_single_dummy_weight(tensor, low, low + 2 * SCALE, seed=seed)


if os.environ.get(ENV):
    apply()
