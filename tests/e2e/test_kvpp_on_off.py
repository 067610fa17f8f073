"""End to end on real ranks: the reference model through the step driver with KVPP, against greedy
tokens by full recomputation without any cache (one process, no KVPP, no compile, no driver).

Workload (scaled down from the reference project's end-to-end test): two prompts sharing a 3-block
prefix, a 32-token budget so the first prompt needs two prefill chunks, the second hitting the prefix
cache, 16 greedy tokens each.
"""

import functools

import pytest
import torch

from kvpp_fx.reference.config import PRESETS, load_config
from kvpp_fx.reference.generate import run_generation
from kvpp_fx.reference.weights import build_model
from tests.reference.helpers import recompute_greedy, shared_prefix_prompts
from tests.support.launch import launch

pytestmark = pytest.mark.multirank

NEW_TOKENS = 16

# Owners by the placement rule (contiguous ranges, lower ranks take the extra layer), written out by hand,
# by (tp, pp). With PP 2 stage 0 has layers 0-1 and stage 1 layers 2-3.
OWNED = {(2, 1): [[0, 1], [2, 3]], (4, 1): [[0], [1], [2], [3]], (2, 2): [[0], [1], [2], [3]]}
STAGE_LAYERS = {(2, 1): [[0, 1, 2, 3]] * 2, (4, 1): [[0, 1, 2, 3]] * 4, (2, 2): [[0, 1]] * 2 + [[2, 3]] * 2}

CASES = [
    pytest.param("tiny", 2, {"graph_mode": "eager"}, True, id="tiny-tp2-eager-and-off"),
    pytest.param("tiny", 4, {"graph_mode": "eager"}, False, id="tiny-tp4-eager"),
    pytest.param("tiny", 4, {"graph_mode": "eager", "pp": 2}, False, id="tiny-tp2xpp2-eager"),
    pytest.param("tiny", 2, {"graph_mode": "piecewise", "inner": "aot_eager"}, False,
                 id="tiny-tp2-piecewise-aot_eager"),
    pytest.param("tiny-sfa", 2, {"graph_mode": "piecewise", "inner": "eager"}, False, id="sfa-tp2-piecewise"),
    pytest.param("tiny-mtp", 2, {"graph_mode": "eager", "speculative": True}, False, id="mtp-tp2-eager-speculative"),
]
# Inductor compiles the pieces in vLLM's mode 2 and mode 3 engines (tests/integrations/vllm/test_vllm_*.py) and in
# `test_backend.py`; here the pieces run aot_eager, which keeps the same graphs at a fraction of the time.


@functools.lru_cache(maxsize=None)
def recomputed(preset: str) -> list[list[int]]:
    """Greedy tokens by full recomputation: every token recomputes the whole sequence, no cache reuse."""
    model = build_model(PRESETS[preset])
    prompts = shared_prefix_prompts(PRESETS[preset].vocab_size)
    return [recompute_greedy(model, p, NEW_TOKENS) for p in prompts]


def on_off(rank: int, world: int, preset: str, options: dict, with_off: bool = True):
    """Rank function: the workload through the step driver with KVPP on (and first off)."""
    prompts = shared_prefix_prompts(load_config(preset).vocab_size)
    out = {"prompts": prompts}
    for kvpp in (False, True) if with_off else (True,):
        torch._dynamo.reset()
        out["on" if kvpp else "off"] = run_generation(rank, world, preset, prompts, NEW_TOKENS,
                                                      dict(options, kvpp=kvpp))
    return out


@pytest.mark.parametrize("preset,world,options,with_off", CASES)
def test_kvpp_matches_full_recomputation(preset, world, options, with_off, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    results = launch(on_off, world, preset, options, with_off, timeout_s=400)
    pp = options.get("pp", 1)
    key = (world // pp, pp)
    for rank, res in enumerate(results):
        stage_layers = STAGE_LAYERS[key][rank]
        on = res["on"]
        assert on["outputs"] == recomputed(preset), f"rank {rank}: KVPP changed the tokens"
        assert on["cached_tokens"][1] >= 48, "the second prompt must hit the 3-block prefix cache"
        first_chunks = [s for s in on["steps"] if any(rid == 0 and start < len(res["prompts"][0])
                                                      for rid, start, _ in s["requests"])]
        assert len(first_chunks) >= 2

        # what the allocator holds on this rank: its own layers (+ local drafts) and two scratch buffers
        drafts = [4] if preset == "tiny-mtp" else []
        assert on["stats"]["persistent_layers"] == OWNED[key][rank] + drafts
        assert on["stats"]["scratch_buffers"] == 2

        # one forward per step; broadcasts only with history, once per target layer, never a draft layer
        assert on["stats"]["forwards"] == len(on["steps"])
        for step in on["steps"]:
            assert step["broadcasts"] == (len(stage_layers) if step["has_history"] else 0), step
        assert sorted(on["stats"]["per_layer"]) == stage_layers
        if preset == "tiny-mtp":
            assert sum(p for p, _ in on["drafts"]) > 0
        if with_off:
            off = res["off"]
            assert off["outputs"] == recomputed(preset)
            assert off["stats"]["persistent_layers"] == stage_layers + drafts
            assert off["stats"]["scratch_buffers"] == 0
            assert off["stats"]["broadcasts"] == 0


def test_a_dropped_broadcast_changes_the_tokens():
    """Negative control: rank 1 sends zeros for layer 2 (it owns it), so rank 0's attention reads zeros."""
    options = {"graph_mode": "eager", "device_api": "tests.support.faults:dropped_broadcast_of_layer_2"}
    results = launch(on_off, 2, "tiny", options, False, timeout_s=400)
    assert results[0]["on"]["outputs"] != recomputed("tiny")
