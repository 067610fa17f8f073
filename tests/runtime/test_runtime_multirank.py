"""The runtime on real ranks: gloo on 127.0.0.1, spawned processes, timeouts everywhere.

Every correctness test here has a negative control: the same test with a deliberate fault fails.
"""

import pytest

from kvpp_fx.launch import run_ranks
from tests.runtime import workers

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("world,tp,pp", [(2, 2, 1), (4, 4, 1), (4, 2, 2)], ids=["tp2", "tp4", "tp2xpp2"])
def test_every_rank_reads_the_owners_bytes(world, tp, pp):
    forwards = 6
    results = run_ranks(workers.correctness_worker, world, tp, pp, 8, forwards, timeout_s=120)
    bytes_per_layer = workers.BLOCKS * workers.BLOCK * workers.WIDTH * 4
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}"
        stage_layers = res["layers"]
        assert len(stage_layers) == 8 // pp
        assert res["stats"]["forwards"] == forwards
        for f, record in enumerate(res["records"]):
            if f % 3 == 0:
                assert not record["has_history"] and record["broadcasts"] == 0 and record["bytes"] == 0
            else:
                assert record["layers"] == stage_layers  # once per target layer, in order
                assert record["bytes"] == len(stage_layers) * bytes_per_layer
        with_history = sum(1 for f in range(forwards) if f % 3)
        assert res["stats"]["bytes"] == with_history * len(stage_layers) * bytes_per_layer
        assert all(v == {"broadcasts": with_history, "exchanges": 0, "bytes": with_history * bytes_per_layer}
                   for v in res["stats"]["per_layer"].values())
        # each rank keeps only its own layers, plus two scratch buffers
        assert res["stats"]["persistent_layers"] == res["owned"]
        assert res["stats"]["scratch_buffers"] == 2
    owned = sorted(layer for res in results for layer in res["owned"])
    assert owned == list(range(8))


@pytest.mark.parametrize("fault", [None, "no-wait"], ids=["runtime", "negative-control-no-wait"])
def test_race_random_skews_never_read_a_view_early(fault):
    forwards = 40
    results = run_ranks(workers.race_worker, 2, forwards, fault, timeout_s=180)
    if fault is None:
        for res in results:
            assert res["early"] == []
            assert res["final_ok"]
            assert res["broadcasts"] == (forwards - 1) * 6
    else:  # without the wait, attention reads and writes slots the broadcast has not filled yet
        assert any(res["early"] for res in results)


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_dead_or_stalled_peer_becomes_an_error_within_the_timeout(how):
    timeout = 3.0
    results = run_ranks(workers.dying_worker, 3, 1, how, timeout, timeout_s=90, may_die={1})
    assert results[1] is None or how == "stall"
    for rank in (0, 2):
        res = results[rank]
        assert res["error"] in ("TransferFailedError", "TransferTimeoutError"), res
        assert res["elapsed"] < timeout + 5.0, res
        assert res["later"] == "RuntimeBrokenError", res
    if how == "stall":  # alive but silent: only the timeout can tell
        assert {results[r]["error"] for r in (0, 2)} == {"TransferTimeoutError"}


def test_a_failed_transfer_breaks_the_runtime_for_good():
    for seen in run_ranks(workers.failing_transfer_worker, 2, timeout_s=60):
        assert seen[0][:2] == ("wait", "TransferFailedError")
        assert "broadcast of layer 2 failed: injected transfer failure" in seen[0][2]
        assert seen[0][3] == "OSError"
        assert seen[1][:2] == ("prefetch", "RuntimeBrokenError")
        assert seen[2][:2] == ("exit", "RuntimeBrokenError")  # the caller swallowed the errors: exit raises
        assert seen[3][:2] == ("later", "RuntimeBrokenError") and seen[4][:2] == ("later", "RuntimeBrokenError")
        assert "injected transfer failure" in seen[3][2] and "new process group" in seen[3][2]
        assert seen[5][0] == "stats-broken" and "injected transfer failure" in seen[5][1]
        assert len(seen) == 6, seen


@pytest.mark.parametrize("mode", ["after-first", "mixed"])
def test_an_aborted_forward_never_yields_wrong_bytes_later(mode):
    results = run_ranks(workers.abort_worker, 2, 4, 3, mode, None, timeout_s=150)
    for rank, res in enumerate(results):
        assert res["wrong"] == [], res
        for outcomes in res["outcomes"]:
            assert set(outcomes) <= {"exact", "broken", "failed:TransferTimeoutError", "failed:TransferFailedError"}, outcomes
            assert outcomes[-1] == "broken"  # every rank ends up refusing: the group is out of step
    if mode == "after-first":  # every rank issued a broadcast and raised: all broken at once
        assert all(o == ["broken"] * 3 for res in results for o in res["outcomes"])


def test_negative_control_without_breaking_an_abort_yields_wrong_bytes():
    results = run_ranks(workers.abort_worker, 2, 1, 3, "mixed", "no-break", timeout_s=150)
    assert any(res["wrong"] for res in results), results


def test_one_rank_raising_a_protocol_error_does_not_hang_its_peer():
    timeout = 3.0
    results = run_ranks(workers.one_rank_errs_worker, 2, timeout, timeout_s=60)
    assert results[0]["error"] == "WaitMismatchError" and results[0]["broken"]
    # rank 1 waits for a broadcast rank 0 never issues: a timeout, or a closed connection once rank 0 exits
    assert results[1]["error"] in ("TransferTimeoutError", "TransferFailedError") and results[1]["broken"]
    for res in results:
        assert res["elapsed"] < timeout + 5.0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "negative-control-serial"])
def test_prefetch_returns_before_its_broadcast_completes(tmp_path, overlap):
    results = run_ranks(workers.overlap_handshake_worker, 2, str(tmp_path), overlap, 3.0, timeout_s=60)
    if overlap:
        assert all(res["ok"] for res in results), results
    else:  # a prefetch that completes its broadcast before returning cannot pass the handshake
        assert not all(res["ok"] for res in results)
        assert any("never returned from prefetch" in (res["error"] or "") for res in results)


@pytest.mark.parametrize("drop,side_stream", [((), False), ((), True), (("transfer",), False), (("compute",), False)],
                         ids=["runtime", "runtime-on-a-side-stream", "negative-control-no-ready-wait",
                              "negative-control-no-done-wait"])
def test_device_ordering_happens_before(drop, side_stream):
    results = run_ranks(workers.ordering_worker, 2, drop, 4, side_stream, timeout_s=60)
    for res in results:
        # 3 forwards with history x 5 broadcasts, and each of the 4 forwards' agreement all-reduce
        assert res["collectives"] == 3 * 5 + 4 and res["accesses"] == 2 * 5 * 4
        if not drop:
            assert res["races"] == [], res["races"][:5]
    if drop:  # rank 1 receives layers 0-2 (slots 0, 1, 0): within a forward, slot 0 is reused
        assert results[1]["races"], "the checker must see the missing wait"
    if drop == ("transfer",):  # the broadcast into a slot races the previous reader of that slot
        assert any("broadcast" in race.split(" is not")[0] for res in results for race in res["races"])


def test_memory_and_stats_stay_flat_over_3000_forwards():
    results = run_ranks(workers.memory_worker, 2, 3000, 300, timeout_s=300)
    for res in results:
        assert res["forwards"] == 3000 and res["broadcasts"] == 3000 * 4
        assert res["sizes"]["end"] == res["sizes"]["warm"]
        assert res["traced_growth"] < 64 * 1024, res
        assert res["rss"]["end"] - res["rss"]["warm"] < 8 * 2**20, res



# --- active blocks ----------------------------------------------------------------------------------------

def test_active_block_fuzz_every_listed_block_arrives_and_nothing_else():
    results = run_ranks(workers.active_fuzz_worker, 2, 25, None, timeout_s=120)
    for res in results:
        assert res["n_problems"] == 0, res["problems"]
        whole_forwards = 0
        for count, nbytes in res["records"]:
            if count > res["staging_blocks"]:  # beyond the staging capacity: whole layers
                assert nbytes == 4 * res["layer_bytes"]
                whole_forwards += 1
            else:  # 4 layers: the listed blocks of kv (bf16 576) + indexer (int8 128) + scale (fp32 1), and ids
                assert nbytes == 4 * count * (res["bpb"] + 8)
        assert 0 < whole_forwards < len(res["records"])
        assert res["layer_bytes"] == res["num_blocks"] * res["bpb"]
        assert res["bpb"] == 4 * (576 * 2 + 128 + 4)


def test_negative_control_a_dropped_block_is_missing_at_the_receiver():
    results = run_ranks(workers.active_fuzz_worker, 2, 6, "drop-block", timeout_s=120)
    assert any(res["n_problems"] for res in results)
    assert all(listed for res in results for (_, _, _, _, listed) in res["problems"])  # only listed blocks


@pytest.mark.parametrize("host_agreement", [False, True], ids=["on-the-kvpp-group", "on-a-host-group"])
def test_ranks_that_disagree_on_the_set_get_a_named_error(host_agreement):
    cases = list(workers.MISMATCHES)
    for outcome in run_ranks(workers.mismatched_sets_worker, 2, cases, host_agreement, timeout_s=60):
        assert {case: outcome[case] for case in cases} == dict.fromkeys(cases, "BlockSetMismatchError")
        assert outcome["out-of-range"] == f"block id {workers.BLOCKS} is outside the pool of {workers.BLOCKS} blocks."
        assert outcome["after"] == "exact"
        assert outcome["agreement_groups"] == {"agreement" if host_agreement else "kvpp"}
        assert outcome["bytes"] == 4 * 2 * (workers.BLOCK * workers.WIDTH * 4 + 8)


@pytest.mark.parametrize("drop", [(), ("transfer",), ("compute",)],
                         ids=["runtime", "negative-control-no-ready-wait", "negative-control-no-done-wait"])
def test_staging_reuse_is_ordered_on_the_device(drop):
    results = run_ranks(workers.active_ordering_worker, 2, drop, 4, timeout_s=60)
    for res in results:
        assert res["collectives"] == 3 * 5 + 4
        if not drop:
            assert res["races"] == [], res["races"][:5]
    if drop:
        assert results[1]["races"]


def test_an_agreement_group_of_other_ranks_is_refused():
    for message in run_ranks(workers.wrong_agreement_group_worker, 2, timeout_s=60):
        assert message is not None and "agreement group's ranks" in message
