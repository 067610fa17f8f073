"""Owner mode in the runtime on real gloo ranks, without a model: results, refusals and failures."""

import pytest

from kvpp_fx.launch import run_ranks
from tests.runtime import owner_workers

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world", [2, 4])
def test_owner_mode_results_and_refusals(world):
    results = run_ranks(owner_workers.owner_protocol_worker, world, timeout_s=120)
    heads, tokens = owner_workers.HEADS_PER_RANK, 3
    part = tokens * heads * (owner_workers.WIDTH + owner_workers.RANK_WIDTH) * 4  # q in + output back, fp32
    layers = 4
    for rank, res in enumerate(results):
        assert res["exact"], f"rank {rank}: owner-mode attention differs from local attention over the owner's bytes"
        owned = layers // world
        assert res["last"] == {"mode": "owner", "broadcasts": 0, "exchanges": layers,
                               "bytes": owned * (world - 1) * part + (layers - owned) * part}
        assert "does not route" in res["unrouted"] and not res["broken_after_unrouted"]
        assert "ran outside its turn" in res["outside_turn"]
        assert "the step's load" in res["auto_without_load"]
        assert "an attention shape" in res["auto_without_shape"]
        assert "3 owner mode" in res["mismatch"] and "Nothing was moved" in res["mismatch"]
        assert "query tokens" in res["load_mismatch"] and "active-block" not in res["load_mismatch"]


def test_a_stalled_peer_in_owner_mode_times_out_and_breaks_the_runtime():
    timeout = 3.0
    results = run_ranks(owner_workers.owner_stall_worker, 2, timeout, timeout_s=90, may_die={1})
    res = results[0]
    assert res["error"] == "TransferTimeoutError", res
    assert res["elapsed"] < timeout + 5.0
    assert res["later"] == "RuntimeBrokenError"
