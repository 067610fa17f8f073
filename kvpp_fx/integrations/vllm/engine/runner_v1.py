"""The adapter for vLLM's V1 model runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` and its CPU
subclass): where each of KVPP's runner-agnostic steps attaches. ``docs/vllm.md`` lists the hooks of both
runners side by side; those they take alike (``load_model``, ``_dummy_run``, ``sample_tokens``,
copy-on-write) are `runner_base.KVPPRunnerBase`'s.

- ``load_model``: `model_hooks.prepare_model`.
- ``initialize_kv_cache_tensors``: KV-sharing layers refused; vLLM's ``allocate_kv_cache`` (as
  ``gpu_model_runner`` calls it) allocates KVPP's layout; `allocation.self_check`.
- ``_model_forward`` (the target model's forward, inside vLLM's forward context): `step.step_forward`
  with the input batch's host arrays and block table.
- ``_dummy_run``: the kvpp ops in passthrough. ``execute_model`` and ``sample_tokens`` (drafting) run
  with the engine current, for the compiled path's backend.
- Compact slots: ``_init_kv_zero_meta`` skipped, ``_zero_block_ids`` and copy-on-write in
  ``_update_states`` on the persistent views only.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from kvpp_fx.integrations.vllm.cache import allocation
from kvpp_fx.integrations.vllm.engine.batch import BlockRows, StepBatch
from kvpp_fx.integrations.vllm.engine.runner_base import KVPPRunnerBase, is_runner, prepare_hooks
from kvpp_fx.integrations.vllm.engine.step import step_forward

KIND = "V1"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
ALLOCATOR_MODULE = RUNNER_MODULE  # V1's runner module calls allocate_kv_cache itself
RUNNER_HOOKS = ("load_model", "initialize_kv_cache", "initialize_kv_cache_tensors", "execute_model", "_model_forward",
                "_dummy_run", "sample_tokens", "get_kv_cache_spec", "_update_states", "_zero_block_ids",
                "_init_kv_zero_meta")


def is_v1_runner(cls: type) -> bool:
    return is_runner(cls, RUNNER_MODULE)


def block_rows(block_tables: Any, num_reqs: int) -> tuple[BlockRows, ...]:
    """The rows of V1's ``MultiGroupBlockTable`` (host copies) for the step's first `num_reqs` requests."""
    return tuple(BlockRows(int(table.block_size), np.asarray(table.block_table.np[:num_reqs]))
                 for table in block_tables.block_tables)


def step_batch(runner: Any) -> StepBatch:
    batch = runner.input_batch
    n = batch.num_reqs
    return StepBatch.of(batch.num_computed_tokens_cpu[:n], np.diff(runner.query_start_loc.np[: n + 1]),
                        batch.num_prompt_tokens[:n], block_rows(batch.block_table, n))


@functools.cache
def kvpp_runner_v1_class(base: type) -> type:
    """KVPP's subclass of vLLM's V1 model runner class `base` (GPU or CPU)."""
    prepare_hooks(base, KIND, RUNNER_MODULE, RUNNER_HOOKS, ALLOCATOR_MODULE)

    class KVPPModelRunner(KVPPRunnerBase, base):  # type: ignore[misc, valid-type]
        def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> Any:
            # A KV connector registers the caches in there, and a KVPP connector asks whose layer each is.
            with self._kvpp.active():
                return super().initialize_kv_cache(*args, **kwargs)

        def initialize_kv_cache_tensors(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
            state = self._kvpp
            allocation.refuse_kv_sharing(getattr(self, "shared_kv_cache_layers", None))
            with allocation.allocating(self, state):
                kv_caches = super().initialize_kv_cache_tensors(kv_cache_config, *args, **kwargs)
            allocation.self_check(self, state, kv_cache_config)
            return kv_caches

        def execute_model(self, *args: Any, **kwargs: Any) -> Any:
            with self._kvpp.active():
                return super().execute_model(*args, **kwargs)

        def _init_kv_zero_meta(self) -> None:
            if not self._kvpp.compact:
                super()._init_kv_zero_meta()

        def _zero_block_ids(self, block_ids: list[int]) -> None:
            if not self._kvpp.compact:
                return super()._zero_block_ids(block_ids)
            allocation.zero_persistent_blocks(self._kvpp, block_ids)

        def _update_states(self, scheduler_output: Any) -> Any:
            return self._kvpp_copy_on_persistent_views(super()._update_states, scheduler_output)

        def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
            with step_forward(self._kvpp, step_batch(self)):
                return super()._model_forward(*args, **kwargs)

    KVPPModelRunner.__name__ = KVPPModelRunner.__qualname__ = f"KVPP{base.__name__}"
    return KVPPModelRunner
