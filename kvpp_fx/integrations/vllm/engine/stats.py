"""What a KVPP worker reports: ``llm.collective_rpc(worker_stats)`` (or ``kvpp_stats`` over a server's
``/collective_rpc``) gives each worker's runtime counters, its allocation and how the engine runs."""

from __future__ import annotations

from typing import Any


def worker_stats(worker: Any = None) -> dict[str, Any] | None:
    """For ``llm.collective_rpc(worker_stats)``: this worker's KVPP counters and allocation."""
    deepseek_v4 = getattr(getattr(worker, "worker", worker), "_kvpp_v4", None)
    if deepseek_v4 is not None:
        stats = deepseek_v4.snapshot()
        stats["worker_class"] = type(getattr(worker, "worker", worker)).__name__
        stats["runner_class"] = type(worker.model_runner).__name__
        context = worker.model_runner.compilation_config.static_forward_context
        stats["attention_backends"] = sorted({layer.get_attn_backend().get_name() for layer in context.values()
                                              if hasattr(layer, "get_attn_backend")})
        return stats
    state = getattr(getattr(worker, "model_runner", None), "_kvpp", None)
    if state is None or state.comm.runtime is None:
        return None
    runtime, counters = state.comm.runtime, state.counters
    stats = runtime.stats()
    stats["num_blocks"] = runtime.storage.num_blocks
    stats["owned_layers"] = list(runtime.plan.owned_layers(runtime.rank))
    stats["draft_layers"] = list(runtime.plan.local_draft_layers)
    stats["compiled_graphs"] = [{"kind": kind, "layers": list(layers)} for kind, layers in counters.compiled_graphs]
    stats["worker_class"] = type(worker.worker if hasattr(worker, "worker") else worker).__name__
    stats["runner_class"] = type(worker.model_runner).__name__
    stats["model_runner"] = state.runner_kind
    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    stats["attention_backends"] = sorted({layer.get_attn_backend().get_name() for name, layer in context.items()
                                          if name in state.vplan.layer_index and hasattr(layer, "get_attn_backend")})
    stats["block_size"] = state.plan.spec.block_size
    stats["steps"] = counters.steps
    stats["mixed_steps"] = counters.mixed_steps
    stats["skipped_cache_writes"] = counters.skipped_cache_writes
    stats["skipped_indexers"] = counters.skipped_indexers
    stats["packed_layers"] = counters.packed_layers
    stats["scratch_blocks"] = state.layout.scratch_blocks
    stats["slot_blocks"] = runtime.storage.slot_blocks
    stats["owner_only"] = state.layout.owner_only
    stats["compact_blocker"] = state.attention.compact_blocker
    stats["streams_history"] = state.attention.streams_history
    stats["kvpp_mode"] = state.attention.mode
    stats["owner_blocker"] = state.attention.owner_blocker
    stats["prefill_rows_with_history"] = counters.prefill_rows_with_history
    stats["device_api"] = state.comm.device_api_factory
    return stats
