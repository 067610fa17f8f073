"""DeepSeek-V3.2 (MLA with sparse attention: each token attends to the 512 context positions its layer's lightning
indexer selects) through vLLM's own classes on vLLM CPU, whose missing sparse kernels are torch stand-ins
(`deepseek_v32_on_cpu`), at TP 2 with KVPP off and on.

KVPP gives each layer's latent cache and indexer keys to one owner. The stand-in's metadata routes every token
through ``forward_mqa`` as a decode row, so a step either sends all its rows to the layers' owners (owner mode,
and "auto" wherever a step reads history) or broadcasts whole layers (vLLM's sparse and indexer metadata are not
remapped to packed slots); the slots stay whole layers (`docs/vllm.md`, the SFA row).
"""

import pytest

from tests.integrations.vllm import deepseek_v32_on_cpu
from tests.integrations.vllm.engine_runs import OWNER_BYTES_PER_TOKEN, SKIPPED_GATHER, run_engines
from tests.integrations.vllm.tiny_model import TINY_DEEPSEEK_V32

pytestmark = pytest.mark.vllm

FAULT = "tests.support.faults:dropped_broadcast_of_layer_1"


@pytest.fixture(scope="module")
def v32_runs(tiny_deepseek_v32_config):
    """The staggered workload (a 700-token prompt, longer than the index top-k, then two short prompts that join
    while it decodes), 8 tokens each, float32, vLLM's defaults (V2, its compile mode for this model: 0, as for
    DeepSeek-V4; chunked prefill and prefix caching as vLLM CPU sets them for MLA), blocks of 16 on every host
    (CPU_MLA named: vLLM CPU's MLA block size without AMX), 64 MiB of KV per rank. KVPP off, then the short
    workload on the same engine; on in "auto", then the short workload in broadcast mode, in broadcast mode
    with the owner of layer 1 broadcasting zeros (a negative control), in owner mode, and in owner mode with no
    gather issued (the owner computes every rank's heads from its own queries: a negative control)."""
    env = {deepseek_v32_on_cpu.ENV: "1"}
    args = {"dtype": "float32", "load_format": "dummy", "attention_backend": "CPU_MLA", "max_model_len": 1024,
            "kv_cache_memory_bytes": 64 << 20}
    common = {"args": args, "env": env, "workload": "staggered", "sampling": {"max_tokens": 8}}
    variants = {"off": {**common, "phases": [{"name": "short"}]}, "on": {**common, "kvpp": True, "phases": [
        {"name": "broadcast", "mode": "broadcast"}, {"name": "dropped", "mode": "broadcast", "fault": FAULT},
        {"name": "owner", "mode": "owner"}, {"name": "skipped-gather", "mode": "owner", "fault": SKIPPED_GATHER}]}}
    return run_engines(tiny_deepseek_v32_config, variants)


def _decode_tokens_of_last_step(schedule) -> int:
    return sum(scheduled for _, scheduled in schedule[-1])


def test_kvpp_gives_the_tokens_of_kvpp_off_with_every_row_on_its_owner(v32_runs):
    """vLLM's V3.2 layers, indexers and sparse MLA at TP 2, the indexers selecting (the long prompt's tokens read
    more context than the top-k, on every rank). KVPP on gives the tokens of KVPP off: in "auto", which sends
    every row of a step with history to the layers' owners (each owner runs its layer's indexer and sparse
    attention for both ranks' heads; the other rank skips the layer's indexer and cache writes), in owner mode
    and in broadcast mode (whole layers every step). A decode step's exchange is its decode tokens' queries and
    outputs, whatever their context: the same bytes per token after 700 tokens as after 90. The controls: a
    layer broadcast as zeros, and no gather in owner mode, change the tokens."""
    off, on = v32_runs["off"], v32_runs["on"]
    assert off["config"]["mode"] == on["config"]["mode"] == 0 and on["config"]["model_runner"] == "V2"
    assert on["config"]["block_size"] == 16
    short = off["phases"]["short"]["tokens"]
    assert len(off["tokens"]) == 3 and len(set(off["tokens"][0])) > 1, off["tokens"]
    assert on["tokens"] == off["tokens"]
    phases = on["phases"]
    assert phases["broadcast"]["tokens"] == short and phases["owner"]["tokens"] == short
    assert phases["dropped"]["tokens"] != short and phases["skipped-gather"]["tokens"] != short
    topk = TINY_DEEPSEEK_V32["index_topk"]
    for run in (off, on):
        for stats in run["indexer"]:
            assert stats["max_context"] > topk and stats["rows_truncated"] > 0, stats
            assert stats["max_selected"] == topk, stats
    layers = TINY_DEEPSEEK_V32["num_hidden_layers"]
    for run, stats_of in ((on, on["stats"]), (phases["owner"], phases["owner"]["stats"])):
        tokens = _decode_tokens_of_last_step(run["schedule"])
        for stats in stats_of:
            assert stats["model_runner"] == "V2" and stats["owner_blocker"] is None, stats
            assert stats["modes"]["owner"] > 0 and stats["skipped_cache_writes"] > 0, stats
            assert stats["skipped_indexers"] == stats["skipped_cache_writes"], stats  # one layer each, non-owner
            assert stats["last_forward"]["mode"] == "owner" and stats["last_forward"]["broadcast_bytes"] == 0
            assert stats["last_forward"]["exchange_bytes"] == tokens * OWNER_BYTES_PER_TOKEN * layers, stats
    for stats in phases["broadcast"]["stats"]:
        assert stats["modes"]["broadcast"] > 0 and stats["broadcasts"] > 0, stats
