"""The runtime on real ranks: gloo on 127.0.0.1, spawned processes, timeouts everywhere."""

import pytest

from kvpp_fx.launch import run_ranks
from tests.runtime import workers

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world,tp,pp", [(2, 2, 1), (4, 4, 1), (4, 2, 2)], ids=["tp2", "tp4", "tp2xpp2"])
def test_every_rank_reads_the_owners_bytes(world, tp, pp):
    forwards = 6
    results = run_ranks(workers.correctness_worker, world, tp, pp, 8, forwards, timeout_s=120)
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}"
        stage_layers = res["layers"]
        assert len(stage_layers) == 8 // pp
        fwd = res["stats"]["forwards"]
        assert len(fwd) == forwards
        for f, record in enumerate(fwd):
            if f % 3 == 0:
                assert not record["has_history"] and record["broadcasts"] == 0 and record["bytes"] == 0
            else:
                assert record["layers"] == stage_layers  # once per target layer, in order
                bytes_per_layer = workers.BLOCKS * workers.BLOCK * workers.WIDTH * 4
                assert record["bytes"] == len(stage_layers) * bytes_per_layer
        # each rank keeps only its own layers, plus two scratch buffers
        assert res["stats"]["persistent_layers"] == res["owned"]
        assert res["stats"]["scratch_buffers"] == 2
    owned = sorted(layer for res in results for layer in res["owned"])
    assert owned == list(range(8))


def test_race_random_delays_never_overwrite_a_view_early():
    forwards = 60
    results = run_ranks(workers.race_worker, 2, forwards, timeout_s=180)
    for res in results:
        assert res["early"] == []
        assert res["final_ok"]
        assert res["broadcasts"] == (forwards - 1) * 6


def test_a_dead_rank_becomes_an_error_within_the_timeout():
    pg_timeout = 5.0
    results = run_ranks(workers.dying_worker, 3, 1, pg_timeout, timeout_s=90, pg_timeout_s=pg_timeout,
                        may_die={1})
    assert results[1] is None
    for rank in (0, 2):
        assert results[rank]["error"] == "TransferFailedError", results[rank]
        assert results[rank]["elapsed"] < pg_timeout + 5.0


def test_a_failed_transfer_is_reraised_at_wait_and_closes_the_forward():
    for seen in run_ranks(workers.failing_transfer_worker, 2, timeout_s=60):
        assert seen[0][:2] == ("wait", "TransferFailedError")
        assert "broadcast of layer 2 failed: injected transfer failure" in seen[0][2]
        assert seen[0][3] == "OSError"
        assert seen[1][:2] == ("prefetch", "ForwardClosedError")
        assert len(seen) == 2, seen
