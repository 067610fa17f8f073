"""Test-only: vLLM 0.32's DeepSeek-V4 on vLLM CPU, with random weights that move the logits.

Three changes, applied in every process of an engine whose environment sets `ENV` (the TP workers are spawned
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
  load the same weights;
- vLLM's block zeroer (``KVBlockZeroer``, which V2's runner builds for V4's caches of mixed precision) zeroes
  a step's new blocks with the stores its Triton kernel's programs make, each a ``memset`` of one segment's
  page (`zero_block_ids`): the same addresses and bytes, which vLLM computes from the caches as it binds
  them. Interpreted, the kernel runs a Python program per block, segment and 1,024 values: a 2,100-token
  prompt's blocks took most of a V4 engine's run (about 45 s a worker). The equivalence, against the kernel
  interpreted: `cases_deepseek_v4.py`.

The engine also needs Triton's interpreter (`triton_interpreter`): V4's metadata builders launch Triton
kernels.
"""

from __future__ import annotations

import ctypes
import os

ENV = "KVPP_TESTS_DEEPSEEK_V4"
SCALE = 0.1
_APPLIED = "_kvpp_tests_deepseek_v4"


def apply() -> None:
    import vllm.model_executor.model_loader.dummy_loader as dummy_loader
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa
    from vllm.v1.worker.utils import KVBlockZeroer

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
    KVBlockZeroer.zero_block_ids = zero_block_ids
    setattr(builder, _APPLIED, True)


def zero_block_ids(self, block_ids: list[int]) -> None:
    """``KVBlockZeroer.zero_block_ids`` on CPU: what ``_zero_kv_blocks_kernel`` stores, for each block and
    segment the segment's page of int32 zeros at its address plus the block times its block stride."""
    if not block_ids or self._meta is None:
        return
    addresses, block_strides, page_sizes = (values.tolist() for values in self._meta[:3])
    for block in block_ids:
        for address, block_stride, page_size in zip(addresses, block_strides, page_sizes):
            ctypes.memset(address + 4 * block * block_stride, 0, 4 * page_size)


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
