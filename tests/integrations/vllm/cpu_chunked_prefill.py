"""Test-only: MLA's chunked-context prefill on vLLM CPU's CPU_MLA backend, as CUDA users run it.

vLLM CPU turns chunked prefill and prefix caching off for MLA on hosts without AMX
(``CpuPlatform.check_and_update_config``), and raises the token budget to ``max_model_len``. Restoring
the configuration's ``enable_chunked_prefill``, ``enable_prefix_caching`` and ``max_num_batched_tokens``
right after that call runs what those settings run on CUDA: later chunks and prefix-cache hits read their
history through ``MLACommonImpl._compute_prefill_context`` (CPU's gather, ``gather_mla_context_cache_cpu``).
Applied in every process of an engine whose environment sets `ENV` (the TP workers are spawned and
re-run the entry module, which imports this one), since vLLM resolves copies of a config there too.
"""

from __future__ import annotations

import os

ENV = "KVPP_TESTS_CPU_CHUNKED_PREFILL"
_APPLIED = "_kvpp_tests_cpu_chunked_prefill"


def apply() -> None:
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform, _APPLIED, False):
        return
    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        kept = (scheduler.enable_chunked_prefill, cache.enable_prefix_caching, scheduler.max_num_batched_tokens)
        original(cls, vllm_config)
        scheduler.enable_chunked_prefill, cache.enable_prefix_caching, scheduler.max_num_batched_tokens = kept

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    setattr(CpuPlatform, _APPLIED, True)


if os.environ.get(ENV):
    apply()
