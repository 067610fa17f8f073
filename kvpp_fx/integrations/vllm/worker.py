"""``llm.collective_rpc(worker_stats)``, at the path docs/vllm.md gives: the function is the engine's
(`engine.stats`); KVPP's worker classes are `engine.worker`'s."""

from kvpp_fx.integrations.vllm.engine.stats import worker_stats

__all__ = ["worker_stats"]
