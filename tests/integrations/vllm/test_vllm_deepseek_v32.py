"""DeepSeek-V3.2 (MLA with sparse attention: each token attends to the 512 context positions its layer's lightning
indexer selects) through vLLM's own classes on vLLM CPU, whose missing sparse kernels are torch stand-ins
(`deepseek_v32_on_cpu`), at TP 2 with KVPP off and on.

KVPP gives each layer's latent cache and indexer keys to one owner. The stand-in's metadata routes every token
through ``forward_mqa`` as a decode row. An engine that starts in "auto" (vLLM's default with KVPP) or owner mode
takes owner-only slots: every row of every step, first prefills included, goes to its layers' owners, and no rank
holds the layers it does not own. One that starts in broadcast mode keeps whole-layer slots (vLLM's sparse and
indexer metadata are not remapped to packed slots) and broadcasts whole layers (`docs/vllm.md`, the SFA row).
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
    workload on the same engine. KVPP on in "auto" (owner-only slots), then the short workload in owner mode,
    in owner mode with no gather issued (the owner computes every rank's heads from its own queries: a negative
    control), and in broadcast mode set after the start. KVPP on from the start in broadcast mode (whole-layer
    slots): the short workload, then again with the owner of layer 1 broadcasting zeros (a negative control)."""
    env = {deepseek_v32_on_cpu.ENV: "1"}
    args = {"dtype": "float32", "load_format": "dummy", "attention_backend": "CPU_MLA", "max_model_len": 1024,
            "kv_cache_memory_bytes": 64 << 20}
    common = {"args": args, "env": env, "workload": "staggered", "sampling": {"max_tokens": 8}}
    broadcast = {"enable_kvpp": True, "kvpp_mode": "broadcast"}
    variants = {"off": {**common, "phases": [{"name": "short"}]}, "on": {**common, "kvpp": True, "phases": [
        {"name": "owner", "mode": "owner"}, {"name": "skipped-gather", "mode": "owner", "fault": SKIPPED_GATHER},
        {"name": "broadcast-later", "mode": "broadcast"}]},
        "broadcast": {**common, "args": {**args, "additional_config": broadcast}, "workload": "short", "kvpp": True,
                      "phases": [{"name": "dropped", "fault": FAULT}]}}
    return run_engines(tiny_deepseek_v32_config, variants)


def _decode_tokens_of_last_step(schedule) -> int:
    return sum(scheduled for _, scheduled in schedule[-1])


def test_kvpp_gives_the_tokens_of_kvpp_off_with_every_row_on_its_owner(v32_runs):
    """vLLM's V3.2 layers, indexers and sparse MLA at TP 2, the indexers selecting (the long prompt's tokens read
    more context than the top-k, on every rank). KVPP on gives the tokens of KVPP off: in "auto" and in owner mode
    on owner-only slots, where every row of every step goes to the layers' owners (each owner runs its layer's
    indexer and sparse attention for both ranks' heads; the other rank skips the layer's indexer and cache
    writes), broadcast mode set later included; and in broadcast mode from the start (whole layers every step).
    A decode step's exchange is its decode tokens' queries and outputs, whatever their context: the same bytes
    per token after 700 tokens as after 90. The controls: no gather in owner mode, and a layer broadcast as
    zeros, change the tokens."""
    off, on, broadcast = v32_runs["off"], v32_runs["on"], v32_runs["broadcast"]
    assert off["config"]["mode"] == on["config"]["mode"] == 0 and on["config"]["model_runner"] == "V2"
    assert on["config"]["block_size"] == 16
    short = off["phases"]["short"]["tokens"]
    assert len(off["tokens"]) == 3 and len(set(off["tokens"][0])) > 1, off["tokens"]
    assert on["tokens"] == off["tokens"]
    phases = on["phases"]
    assert phases["owner"]["tokens"] == short and phases["broadcast-later"]["tokens"] == short
    assert broadcast["tokens"] == short
    assert phases["skipped-gather"]["tokens"] != short and broadcast["phases"]["dropped"]["tokens"] != short
    topk = TINY_DEEPSEEK_V32["index_topk"]
    for run in (off, on):
        for stats in run["indexer"]:
            assert stats["max_context"] > topk and stats["rows_truncated"] > 0, stats
            assert stats["max_selected"] == topk, stats
    layers = TINY_DEEPSEEK_V32["num_hidden_layers"]
    for run in (on, phases["owner"], phases["broadcast-later"]):
        tokens = _decode_tokens_of_last_step(run["schedule"])
        for stats in run["stats"]:
            assert stats["model_runner"] == "V2" and stats["owner_blocker"] is None, stats
            assert stats["owner_only"] and stats["slot_blocks"] == 1, stats
            assert stats["modes"]["owner"] == stats["forwards"] and stats["modes"]["broadcast"] == 0, stats
            assert stats["broadcasts"] == 0 and stats["skipped_cache_writes"] > 0, stats
            assert stats["skipped_indexers"] == stats["skipped_cache_writes"], stats  # one layer each, non-owner
            assert stats["last_forward"]["mode"] == "owner" and stats["last_forward"]["broadcast_bytes"] == 0
            assert stats["last_forward"]["exchange_bytes"] == tokens * OWNER_BYTES_PER_TOKEN * layers, stats
    for stats in broadcast["stats"]:
        assert not stats["owner_only"] and stats["scratch_blocks"] is None, stats
        assert stats["modes"]["broadcast"] == stats["forwards"] and stats["broadcasts"] > 0, stats


def test_owner_only_slots_hold_more_blocks_than_kvpp_off(v32_runs):
    """At equal KV memory (64 MiB per rank), an engine on owner-only slots holds each rank's own layer and two
    slots of one block. A block of a layer: 16 tokens of 576 float32 latent values and 132 bytes of indexer key
    (128 fp8 values and a float32 scale). KVPP off holds both layers: 64 MiB // (2 x 38,976) = 860 blocks. Owner-
    only: each slot takes one 2 MiB-aligned buffer, so (64 - 4) MiB // 38,976 = 1,614 blocks, 1.88x (at least
    1.5x). Whole-layer slots (broadcast mode from the start) hold fewer than KVPP off."""
    off, on, broadcast = (v32_runs[name]["num_blocks"] for name in ("off", "on", "broadcast"))
    assert len(set(off)) == len(set(on)) == len(set(broadcast)) == 1, (off, on, broadcast)
    layer_block = 16 * (576 * 4 + 128 + 4)
    assert off[0] == (64 << 20) // (2 * layer_block) == 860
    assert on[0] == ((64 << 20) - 2 * (2 << 20)) // layer_block == 1614 and on[0] >= 1.5 * off[0], (on, off)
    assert broadcast[0] < off[0], (broadcast, off)
