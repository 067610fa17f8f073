"""KVPP on DeepSeek-V4 in vLLM engines: vLLM 0.32's own DeepSeek-V4 classes on vLLM CPU at TP 2, bfloat16, each
target layer's rows on its owner (`attention.deepseek_v4`), each rank's cache re-laid out with only its layers
(`cache.deepseek_v4`).

The model is `tiny_model.TINY_DEEPSEEK_V4` (a window-only layer, two ratio-4 layers with the indexer, a
ratio-128 layer), with vLLM's dummy weights widened and seeded alike in every engine (`deepseek_v4_on_cpu`,
which also patches vLLM 0.32's CPU window-cache metadata builder); V4's metadata builders run under Triton's
interpreter. The workload: two short prompts decode while a prompt of 2,100 tokens prefills next to them (over
4 x index top-k 512, so the ratio-4 layers' indexers select), then all three decode.
"""

import pytest

from tests.integrations.vllm.deepseek_v4_on_cpu import ENV as DEEPSEEK_V4_ENV
from tests.integrations.vllm.engine_runs import run_engines
from tests.integrations.vllm.tiny_model import TINY_DEEPSEEK_V4

pytestmark = pytest.mark.vllm

V4_ARGS = {"dtype": "bfloat16", "max_model_len": 4096, "kv_cache_memory_bytes": 256 << 20, "load_format": "dummy"}
SWAPPED_OUTPUTS = "tests.support.counted_faults:SwappedOwnerOutputs"
LONG_PROMPT = 2100
# owners balance a request's bytes: the ratio-4 layers 1 and 3 on different ranks, the ratio-128 layer 2 and
# the window-only layer 0 on the rank with less
OWNED = [[1, 2], [0, 3]]


@pytest.fixture(scope="module")
def v4_runs(tiny_deepseek_v4_config):
    """vLLM's defaults (V2 runner, mode 0) with KVPP off; on, then the same engine with one layer's outputs
    handed to the wrong ranks (the negative control); V1 runner, on. Eight tokens a request: the long
    prompt's prefill and the decode steps beside it come first."""
    env = {DEEPSEEK_V4_ENV: "1"}
    common = {"workload": "v4_staggered", "args": V4_ARGS, "sampling": {"max_tokens": 8}}
    return run_engines(tiny_deepseek_v4_config, {
        "off": {**common, "env": env, "kvpp": False},
        "on": {**common, "env": env, "kvpp": True, "fault": SWAPPED_OUTPUTS},
        "v1": {**common, "env": {**env, "VLLM_USE_V2_MODEL_RUNNER": "0"}, "kvpp": True},
    })


def test_kvpp_gives_the_tokens_of_kvpp_off(v4_runs):
    off = v4_runs["off"]
    tokens = off["tokens"]
    assert len({tuple(t) for t in tokens}) == 3, tokens  # different prompts, different tokens
    # a step prefills the long prompt next to the short ones' decode rows
    assert any([40, 1] in step and [0, LONG_PROMPT] in step for step in off["schedule"]), off["schedule"]
    for name in ("on", "v1"):
        assert v4_runs[name]["tokens"] == tokens, name
    assert v4_runs["v1"]["config"]["model_runner"] == "V1" and off["config"]["model_runner"] == "V2"
    # vLLM's default for DeepSeek-V4 is breakable CUDA graphs, which turns compilation off on every platform
    assert off["config"]["mode"] == 0


def test_every_target_layer_runs_on_its_owner_in_every_forward(v4_runs):
    for name in ("on", "v1"):
        stats = v4_runs[name]["stats"]
        assert [s["owned_layers"] for s in stats] == OWNED, name
        for s in stats:
            forwards = s["forwards"]
            assert forwards >= len(v4_runs[name]["schedule"]) > 0, name
            assert all(layer["exchanges"] == forwards for layer in s["per_layer"].values()), (name, s["per_layer"])
            assert s["modes"]["owner"] == forwards and s["broken"] is None
    # the last step decodes two requests: per layer, each rank ships 2 tokens x 4 heads x 512 bf16 values of
    # queries out and as many outputs back (as the owner, its peer's); 4 layers
    heads = TINY_DEEPSEEK_V4["num_attention_heads"] // 2
    last = v4_runs["on"]["stats"][0]["last_forward"]
    assert last["rows"] == {"owner": 2}
    assert last["exchange_bytes"] == 4 * 2 * (2 * heads * TINY_DEEPSEEK_V4["head_dim"] * 2)


def test_each_rank_holds_only_its_layers_pages(v4_runs):
    """vLLM's own block count at equal KV memory: the ranks' blocks hold the pages of two layers each (at most
    47,808 bytes, of the 93,888 vLLM packs), so vLLM plans 1.96x the blocks of KVPP off."""
    off, on = v4_runs["off"]["num_blocks"], v4_runs["on"]["num_blocks"]
    assert len(set(off)) == len(set(on)) == 1
    assert on[0] >= 1.7 * off[0], (on, off)
    allocation = [s["allocation"] for s in v4_runs["on"]["stats"]]
    assert [a["packed_block_stride"] for a in allocation] == [93888, 93888]
    assert [a["block_stride"] for a in allocation] == [47808, 46080]
    assert all(a["num_blocks"] == on[0] for a in allocation)
    # what backs the caches vLLM bound to the layers, each storage once: only the rank's own pages
    backing = v4_runs["on"]["kv_cache_bytes"]
    assert backing == [on[0] * 47808, on[0] * 46080] == [a["allocated_bytes"] for a in allocation]
    assert v4_runs["off"]["kv_cache_bytes"] == [off[0] * 93888] * 2
    assert on[0] * 47808 <= V4_ARGS["kv_cache_memory_bytes"] < (on[0] + 1) * 47808
    assert off[0] == V4_ARGS["kv_cache_memory_bytes"] // 93888


def test_one_layers_outputs_on_the_wrong_ranks_change_the_tokens(v4_runs):
    run = v4_runs["on"]
    assert run["faulty"] != run["tokens"]
    counts = [c["SwappedOwnerOutputs"] for c in run["faulty_counts"]]
    # each rank owns two of the four layers: it scatters for both in every forward, and rank 0 swapped the
    # second layer's, once a forward
    assert counts[0]["scatters"] == 2 * counts[0]["swapped"] == counts[1]["scatters"] > 0, counts
    assert counts[1].get("swapped", 0) == 0, counts
