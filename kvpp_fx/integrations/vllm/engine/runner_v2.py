"""The adapter for vLLM's V2 model runner (``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` and its CPU
subclass), vLLM's default wherever Triton runs: where each of KVPP's runner-agnostic steps attaches.
``docs/vllm.md`` lists the hooks of both runners side by side; those they take alike (``load_model``,
``_dummy_run``, ``sample_tokens``, copy-on-write) are `runner_base.KVPPRunnerBase`'s.

- ``load_model``: `model_hooks.prepare_model`.
- ``initialize_kv_cache``: KV-sharing layers (V2 finds them with ``attn_utils.get_shared_kv_cache_layers``)
  refused; vLLM's ``allocate_kv_cache`` (as ``gpu.attn_utils`` calls it) allocates KVPP's layout;
  `allocation.self_check`; a FULL CUDA-graph mode that V2's graph manager resolved is refused; the
  block tables get a host mirror (`HostBlockTables`).
- ``execute_model``: a step (``dummy_run=False``) is pending; ``prepare_attn`` (which V2 calls for real
  steps only, after the batch is prepared) records its `StepBatch`; vLLM's forward context around the
  model call (``set_forward_context`` as ``gpu.model_runner`` calls it, the one bracket shared by the
  eager, piecewise, breakable-CUDA-graph and micro-batched branches) then opens `step.step_forward`
  inside it. Dummy and profile runs (``dummy_run=True``) run the kvpp ops in passthrough. V2's warm-up
  on a GPU (``gpu.warmup.warmup_kernels``, inside the worker's passthrough) schedules real requests on
  real block ids: its steps are KVPP steps like any other, since in passthrough a non-owned layer would
  be written and read at pool block ids in its scratch slot, past the end of a compact one.
- ``sample_tokens`` (sampling and drafting) runs with the engine current, outside any forward.
- Compact slots: the block zeroer and copy-on-write in ``update_requests`` on the persistent views only.

Block ids live only in V2's device block tables (staged writes are cleared once applied); the host
mirror records what ``BlockTables.append_block_ids`` stages, row by row, so a step's rows are a host
gather in batch order (``input_batch.idx_mapping_np``) and no step reads a device tensor. Under prefill
context parallelism the step is the PCP manager's global batch, the same on every rank of the group.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpp_fx.integrations.vllm.cache import allocation
from kvpp_fx.integrations.vllm.engine.batch import BlockRows, StepBatch
from kvpp_fx.integrations.vllm.engine.runner_base import KVPPRunnerBase, is_runner, prepare_hooks
from kvpp_fx.integrations.vllm.engine.state import EngineState, KVPPAllocationError, KVPPHookError, wrap_module_function
from kvpp_fx.integrations.vllm.engine.step import step_forward
from kvpp_fx.runtime.graph_ops import passthrough

KIND = "V2"
RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
ALLOCATOR_MODULE = "vllm.v1.worker.gpu.attn_utils"
RUNNER_HOOKS = ("load_model", "initialize_kv_cache", "execute_model", "prepare_attn", "_dummy_run", "sample_tokens",
                "get_kv_cache_spec", "update_requests", "_init_kv_zero_meta")


def is_v2_runner(cls: type) -> bool:
    return is_runner(cls, RUNNER_MODULE)


class HostBlockTables:
    """A host copy of V2's block tables, kept by wrapping the instance's ``append_block_ids``: the only
    writer of their rows (``add_requests`` with ``overwrite=True``, ``update_requests`` appending)."""

    def __init__(self, tables: Any) -> None:
        self.tables = tables
        self.block_sizes = [int(size) for size in tables.block_sizes]
        self.rows = [np.zeros(tuple(table.gpu.shape), dtype=np.int64) for table in tables.block_tables]
        self.counts = np.zeros((len(self.rows), self.rows[0].shape[0] if self.rows else 0), dtype=np.int64)
        self._append = tables.append_block_ids

    @classmethod
    def attach(cls, tables: Any) -> HostBlockTables:
        mirror = cls(tables)
        tables.append_block_ids = mirror.append_block_ids
        return mirror

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        self._append(req_index, new_block_ids, overwrite)
        null = bool(getattr(self.tables, "redirect_writes_to_null_block", False))
        for group, ids in enumerate(new_block_ids):
            start = 0 if overwrite else int(self.counts[group, req_index])
            end = start + len(ids)
            self.rows[group][req_index, start:end] = 0 if null else ids
            if overwrite:
                self.rows[group][req_index, end:] = 0
            self.counts[group, req_index] = end

    def step_rows(self, idx_mapping: np.ndarray) -> tuple[BlockRows, ...]:
        """Each group's rows of the requests at `idx_mapping` (batch order), gathered where a step reads
        them: a step's host work follows its requests, not the table's width."""
        order = np.array(idx_mapping, dtype=np.int64)  # V2 refills its mapping for the next step
        return tuple(BlockRows(size, rows, order) for size, rows in zip(self.block_sizes, self.rows))


def step_batch(runner: Any, input_batch: Any) -> StepBatch:
    """The step's `StepBatch` from V2's input batch (under PCP, the manager's global batch)."""
    if getattr(runner, "pcp_manager", None) is not None:
        input_batch = runner.pcp_manager.global_batch
    n = input_batch.num_reqs
    return StepBatch.of(input_batch.num_computed_tokens_np[:n], np.diff(input_batch.query_start_loc_np[: n + 1]),
                        input_batch.prefill_len_np[:n], runner._kvpp_tables.step_rows(input_batch.idx_mapping_np[:n]))


@dataclass
class PendingStep:
    """A real step of a KVPP runner between ``execute_model``'s entry and its model call."""

    state: EngineState
    batch: StepBatch | None = None


_PENDING: contextvars.ContextVar[PendingStep | None] = contextvars.ContextVar("kvpp_vllm_v2_step", default=None)


def install_step_bracket() -> None:
    """Wrap ``set_forward_context`` as V2's model runner module calls it (idempotent): with a KVPP step
    pending, the runtime's forward opens inside vLLM's forward context; otherwise it is vLLM's."""
    wrap_module_function(RUNNER_MODULE, "set_forward_context", step_bracket)


def step_bracket(original: Callable) -> Callable:
    """vLLM's ``set_forward_context`` `original`, with a pending KVPP step's forward open inside it."""

    def bracket(*args: Any, **kwargs: Any) -> Iterator[Any]:
        pending = _PENDING.get()
        with original(*args, **kwargs) as context:
            if pending is None:
                yield context
                return
            if pending.batch is None:
                raise KVPPHookError("vLLM's V2 runner ran the target model without prepare_attn: KVPP has no "
                                    "batch for this step.")
            with step_forward(pending.state, pending.batch):
                yield context

    return contextlib.contextmanager(bracket)


class PersistentBlockZeroer:
    """V2's ``kv_block_zeroer`` with compact slots: vLLM's zeroing on the persistent views only."""

    def __init__(self, state: EngineState) -> None:
        self.state = state

    def zero_block_ids(self, block_ids: list[int]) -> None:
        allocation.zero_persistent_blocks(self.state, list(block_ids))

    def warmup(self, num_blocks: int) -> None:
        pass


@functools.cache
def kvpp_runner_v2_class(base: type) -> type:
    """KVPP's subclass of vLLM's V2 model runner class `base` (GPU or CPU)."""
    prepare_hooks(base, KIND, RUNNER_MODULE, RUNNER_HOOKS, ALLOCATOR_MODULE)
    install_step_bracket()

    class KVPPModelRunnerV2(KVPPRunnerBase, base):  # type: ignore[misc, valid-type]
        _kvpp_tables: HostBlockTables

        def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
            from vllm.v1.worker.gpu.attn_utils import get_shared_kv_cache_layers

            state = self._kvpp
            allocation.refuse_kv_sharing(get_shared_kv_cache_layers(self.vllm_config))
            # A KV connector registers the caches in there, and a KVPP connector asks whose layer each is.
            with state.active(), allocation.allocating(self, state):
                result = super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
            allocation.self_check(self, state, self.kv_cache_config)
            mode = getattr(self.cudagraph_manager, "cudagraph_mode", None)
            if mode is not None and mode.has_full_cudagraphs():
                raise KVPPAllocationError(
                    f"vLLM's V2 runner resolved cudagraph_mode to {mode.name}: KVPP supports eager execution or "
                    "PIECEWISE only; set compilation_config={'cudagraph_mode': 'PIECEWISE'}.")
            self._kvpp_tables = HostBlockTables.attach(self.block_tables)
            return result

        def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None, dummy_run: bool = False,
                          **kwargs: Any) -> Any:
            state = self._kvpp
            with state.active(), (passthrough() if dummy_run else contextlib.nullcontext()):
                pending = None if dummy_run else PendingStep(state)
                token = _PENDING.set(pending)
                try:
                    return super().execute_model(scheduler_output, intermediate_tensors, dummy_run=dummy_run, **kwargs)
                finally:
                    _PENDING.reset(token)

        def prepare_attn(self, input_batch: Any) -> Any:
            result = super().prepare_attn(input_batch)
            pending = _PENDING.get()
            if pending is not None and pending.state is self._kvpp:
                pending.batch = step_batch(self, input_batch)
            return result

        def _init_kv_zero_meta(self) -> None:
            if self._kvpp.compact:
                self.kv_block_zeroer = PersistentBlockZeroer(self._kvpp)
            else:
                super()._init_kv_zero_meta()

        def update_requests(self, scheduler_output: Any) -> Any:
            return self._kvpp_copy_on_persistent_views(super().update_requests, scheduler_output)

    KVPPModelRunnerV2.__name__ = KVPPModelRunnerV2.__qualname__ = f"KVPP{base.__name__}V2"
    return KVPPModelRunnerV2
