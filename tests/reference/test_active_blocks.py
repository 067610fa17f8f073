"""Active-block broadcasts through the reference engine on real ranks.

Every case compares KVPP with active blocks against an independent reference (greedy decoding by full
recomputation, no cache at all), checks that the active path really ran (bytes per step equal the read
blocks' share, not whole layers), and the negative control leaves one block of every set out at the receivers.
"""

import functools

import pytest

from kvpp_fx.cache.placement import BLOCK_ID_BYTES
from kvpp_fx.reference.config import PRESETS
from kvpp_fx.reference.generate import run_generation
from kvpp_fx.reference.weights import build_model
from tests.reference.helpers import recompute_greedy, shared_prefix_prompts
from tests.support.launch import launch

pytestmark = pytest.mark.multirank

NEW_TOKENS = 12
POOL = 64  # compact slots of 18 blocks (max_model_len 256 + a 24-token budget); the workload reads at most 9


def expected(preset, prompts):
    return _expected(preset, tuple(tuple(p) for p in prompts))


@functools.lru_cache(maxsize=None)
def _expected(preset, prompts):
    model = build_model(PRESETS[preset])
    return [recompute_greedy(model, list(p), NEW_TOKENS) for p in prompts]


def bundle_bytes_per_block(preset, block_size=16):
    spec = PRESETS[preset].cache_spec(block_size)
    return spec.bytes_per_block(0)


def run(preset, world, graph_mode, *, speculative=False, device_api=None):
    prompts = shared_prefix_prompts(PRESETS[preset].vocab_size)
    # A 24-token budget puts the first prompt's chunk boundary in the middle of its second block.
    options = {"kvpp": True, "graph_mode": graph_mode, "token_budget": 24, "num_blocks": POOL,
               "speculative": speculative, "device_api": device_api}
    results = launch(run_generation, world, preset, prompts, NEW_TOKENS, options, timeout_s=240)
    return prompts, results


def check_active_path(results, preset, layers):
    per_block = bundle_bytes_per_block(preset) + BLOCK_ID_BYTES
    for res in results:
        assert res["slot_blocks"] == -(-256 // 16) - (-24 // 16) == 18 and res["num_blocks"] == POOL  # S far below
        steps = res["steps"]
        assert steps[0]["has_history"] is False and steps[0]["broadcast_bytes"] == 0
        assert any(s["requests"][0][1] % 16 and s["requests"][0][1] < 48 for s in steps[1:3]), \
            "a prefill chunk must start inside a block"
        assert res["cached_tokens"][1] >= 48, "the second prompt hits the 3-block prefix"
        for s in steps[1:]:
            assert 0 < s["active_blocks"] < s["pool_blocks"] // 4
            assert s["broadcast_bytes"] == layers * s["active_blocks"] * per_block, s


@pytest.mark.parametrize("preset,world,mode,speculative", [
    ("small", 2, "eager", False),
    ("tiny-sfa", 2, "piecewise", False),
    ("tiny-mtp", 4, "piecewise", True),
], ids=["tp2-eager-mla-8-layers", "tp2-piecewise-sfa", "tp4-piecewise-mtp"])
def test_active_blocks_match_full_recomputation(preset, world, mode, speculative):
    prompts, results = run(preset, world, mode, speculative=speculative)
    truth = expected(preset, prompts)
    for res in results:
        assert res["outputs"] == truth
    check_active_path(results, preset, PRESETS[preset].num_hidden_layers)
    if speculative:
        assert sum(p for p, _ in results[0]["drafts"]) >= NEW_TOKENS // 2


def test_negative_control_a_dropped_block_changes_the_tokens():
    # 8 layers on 2 ranks: each receiver's scratch slot is shared by two layers, so a block left out of
    # the broadcast holds the other layer's bytes. (Where a slot serves one layer only, a receiver's own
    # writes of earlier steps would still be there, and only the scratch bytes would tell.)
    prompts, results = run("small", 2, "eager", device_api="tests.support.faults:DroppedBlock")
    assert results[0]["outputs"] != expected("small", prompts)
