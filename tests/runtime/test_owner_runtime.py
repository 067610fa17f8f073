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
        assert "the step's load" in res["auto_without_load"] and "the step's load" in res["owner_without_load"]
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


def test_owner_mode_failures_are_named_and_prompt():
    results = run_ranks(owner_workers.owner_failures_worker, 2, timeout_s=120)
    for rank, res in enumerate(results):
        # a non-owner's scratch slot is not written in owner mode; the owner's persistent cache is
        assert res["written"] == {layer: layer in res["owned"] for layer in range(4)}, res["written"]
        name, elapsed, broken = res["owner_failure"]
        assert name == ("IndexError" if rank == 0 else "OwnerRoutingError") and broken
        assert elapsed < 10.0  # from the scatter's status, not the 20 s timeout
        message, broken = res["unrouted_owner"]
        assert "layers [2, 3] is not routed" in message and not broken
        assert res["unrouted_auto"] == {"mode": "broadcast",
                                        "why": "layers [2, 3] are not known to be routed for owner mode"}
    assert results[1]["token_mismatch"][0] == "OwnerRoutingError"
    assert "holds 4 query tokens, the forward's load 3" in results[1]["token_mismatch"][1]
    assert results[0]["token_mismatch"][0] == "TransferTimeoutError"
