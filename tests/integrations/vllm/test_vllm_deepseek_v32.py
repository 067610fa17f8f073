"""DeepSeek-V3.2 (MLA with sparse attention: each token attends to the 512 context positions its layer's lightning
indexer selects) through vLLM's own classes on vLLM CPU, whose missing sparse kernels are torch stand-ins
(`deepseek_v32_on_cpu`), at TP 2 with KVPP off and on.

KVPP gives each layer's latent cache and indexer keys to one owner; vLLM's sparse and indexer metadata are not
remapped, so every step broadcasts whole layers, decode steps included (`docs/vllm.md`, the SFA row).
"""

import pytest

from tests.integrations.vllm import deepseek_v32_on_cpu
from tests.integrations.vllm.engine_runs import EAGER, run_engines
from tests.integrations.vllm.tiny_model import TINY_DEEPSEEK_V32

pytestmark = pytest.mark.vllm

FAULT = "tests.support.faults:dropped_broadcast_of_layer_1"


@pytest.fixture(scope="module")
def v32_runs(tiny_deepseek_v32_config):
    """The staggered workload (a 700-token prompt, longer than the index top-k, then two short prompts that join
    while it decodes), 8 tokens each, float32, V2, eager, blocks of 16 on every host (CPU_MLA named: vLLM CPU's
    MLA block size without AMX), 64 MiB of KV per rank: KVPP off; on, then on again with the owner of layer 1
    broadcasting zeros instead of its layer (the negative control)."""
    env = {deepseek_v32_on_cpu.ENV: "1"}
    args = {**EAGER, "dtype": "float32", "load_format": "dummy", "attention_backend": "CPU_MLA",
            "max_model_len": 1024, "kv_cache_memory_bytes": 64 << 20}
    common = {"args": args, "env": env, "workload": "staggered", "sampling": {"max_tokens": 8}}
    variants = {"off": common, "on": {**common, "kvpp": True, "fault": FAULT}}
    return run_engines(tiny_deepseek_v32_config, variants)


def test_kvpp_gives_the_tokens_of_kvpp_off_with_the_indexer_selecting(v32_runs):
    """vLLM's V3.2 layers, indexer and sparse MLA at TP 2: KVPP on gives the tokens of KVPP off; the long prompt's
    tokens read more context than the index top-k (the indexers select) on every rank; each target layer is
    broadcast from its owner on every step. The control: layer 1's owner broadcasting zeros changes the tokens."""
    off, on = v32_runs["off"], v32_runs["on"]
    assert len(off["tokens"]) == 3 and len(set(off["tokens"][0])) > 1, off["tokens"]
    assert on["tokens"] == off["tokens"]
    topk = TINY_DEEPSEEK_V32["index_topk"]
    for run in (off, on):
        for stats in run["indexer"]:
            assert stats["max_context"] > topk and stats["rows_truncated"] > 0, stats
            assert stats["max_selected"] == topk, stats
    for stats in on["stats"]:
        assert stats["model_runner"] == "V2" and stats["broadcasts"] > 0, stats
        assert stats["owner_blocker"] is not None and "SFA" in stats["owner_blocker"], stats
    assert on["faulty"] != off["tokens"]
