"""End to end on real ranks: the reference model through the step driver, KVPP on == KVPP off.

Workload (scaled down from the reference project's end-to-end test): two prompts sharing a 3-block
prefix, a 32-token budget so the first prompt needs two prefill chunks, the second hitting the prefix
cache, 16 greedy tokens each.
"""

import pytest

from kvpp_fx.launch import run_ranks
from tests.e2e import workers

pytestmark = pytest.mark.multirank

# Owners by the placement rule (contiguous ranges, lower ranks take the extra layer), written out by hand,
# by (tp, pp). With PP 2 stage 0 has layers 0-1 and stage 1 layers 2-3.
OWNED = {(2, 1): [[0, 1], [2, 3]], (4, 1): [[0], [1], [2], [3]], (2, 2): [[0], [1], [2], [3]]}
STAGE_LAYERS = {(2, 1): [[0, 1, 2, 3]] * 2, (4, 1): [[0, 1, 2, 3]] * 4, (2, 2): [[0, 1]] * 2 + [[2, 3]] * 2}

CASES = [
    pytest.param("tiny", 2, {"graph_mode": "eager"}, id="tiny-tp2-eager"),
    pytest.param("tiny", 4, {"graph_mode": "eager"}, id="tiny-tp4-eager"),
    pytest.param("tiny", 4, {"graph_mode": "eager", "pp": 2}, id="tiny-tp2xpp2-eager"),
    pytest.param("tiny", 2, {"graph_mode": "piecewise", "inner": "eager"}, id="tiny-tp2-piecewise-eager"),
    pytest.param("tiny", 2, {"graph_mode": "piecewise", "inner": "aot_eager"}, id="tiny-tp2-piecewise-aot_eager"),
    pytest.param("tiny-sfa", 2, {"graph_mode": "piecewise", "inner": "eager"}, id="sfa-tp2-piecewise"),
    pytest.param("tiny-mtp", 2, {"graph_mode": "eager", "speculative": True}, id="mtp-tp2-eager-speculative"),
    pytest.param("tiny", 2, {"graph_mode": "piecewise", "inner": "inductor"}, id="tiny-tp2-piecewise-inductor",
                 marks=pytest.mark.inductor),
]


@pytest.mark.parametrize("preset,world,options", CASES)
def test_kvpp_on_equals_off(preset, world, options):
    results = run_ranks(workers.on_off, world, preset, options, timeout_s=400)
    pp = options.get("pp", 1)
    key = (world // pp, pp)
    for rank, res in enumerate(results):
        stage_layers = STAGE_LAYERS[key][rank]
        on, off = res["on"], res["off"]
        assert on["outputs"] == off["outputs"], f"rank {rank}: KVPP changed the tokens"
        assert all(len(o) == workers.NEW_TOKENS for o in on["outputs"])
        assert on["cached_tokens"][1] >= 48, "the second prompt must hit the 3-block prefix cache"
        first_chunks = [s for s in on["steps"] if any(rid == 0 and start < len(res["prompts"][0])
                                                      for rid, start, _ in s["requests"])]
        assert len(first_chunks) >= 2

        # what the allocator holds on this rank: its own layers (+ local drafts) and two scratch buffers
        drafts = [4] if preset == "tiny-mtp" else []
        assert on["stats"]["persistent_layers"] == OWNED[key][rank] + drafts
        assert on["stats"]["scratch_buffers"] == 2
        assert off["stats"]["persistent_layers"] == stage_layers + drafts
        assert off["stats"]["scratch_buffers"] == 0

        # one forward per step; broadcasts only with history, once per target layer, never a draft layer
        forwards = on["stats"]["forwards"]
        assert len(forwards) == len(on["steps"])
        for step, fwd in zip(on["steps"], forwards):
            assert fwd["has_history"] == step["has_history"]
            assert fwd["layers"] == (stage_layers if step["has_history"] else [])
        assert sorted(on["stats"]["per_layer"]) == stage_layers
        assert off["stats"]["broadcasts"] == 0
        if preset == "tiny-mtp":
            assert sum(p for p, _ in on["drafts"]) > 0
