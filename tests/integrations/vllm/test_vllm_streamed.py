"""Prefill history streamed from the owners in vLLM engines with chunked prefill and prefix caching on:
CPU_MLA with and without MTP, TRITON_MLA with MTP, and the platform's own MLA backend; the bytes the
chunks move and the history faults.

Each fixture here starts its engines once, in a check interpreter of its own (`engine_runs`); the
model is the session's tiny DeepSeek-V3 (`conftest.tiny_deepseek`) unless the fixture makes its own.
"""

import pytest

from tests.integrations.vllm import triton_mla_on_cpu
from tests.integrations.vllm.engine_runs import (
    CHUNKED_ENV,
    EAGER,
    FAULT,
    HISTORY_ROWS,
    HOST_HAS_AMX,
    MTP,
    MTP_CPU_MLA,
    PLATFORM_MLA,
    SKIPPED_HISTORY,
    WRONG_RANK_HISTORY,
    run_engines,
)
from tests.integrations.vllm.tiny_model import NUM_LAYERS

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def streamed_runs(tiny_deepseek):
    """CPU_MLA at TP 2 with chunked prefill and prefix caching on: with MTP in eager mode (CPU_MLA runs its
    verification rows as prefill rows, so their history streams too; 8 tokens a request), and without MTP
    in mode 3 (its pieces run by vLLM's eager backend: the history streams inside the attention op, which
    vLLM keeps out of the pieces; inductor pieces: `test_vllm_owner.owner_runs`); KVPP off and on each.
    Negative controls on the MTP engine: each history chunk broadcast from the rank that gathered nothing,
    then no chunk broadcast at all."""
    mtp = {**HISTORY_ROWS, **EAGER, "attention_backend": "CPU_MLA", "speculative_config": MTP_CPU_MLA}
    plain = {**HISTORY_ROWS, "attention_backend": "CPU_MLA"}
    shared = {"env": CHUNKED_ENV, "workload": "shared_prefixes"}
    eight = {"max_tokens": 8}  # CPU_MLA runs each verification row as a prefill row: slow steps
    variants = {
        "mtp-off": {"args": mtp, **shared, "sampling": eight},
        "mtp-on": {"kvpp": True, "args": mtp, **shared, "sampling": eight, "fault": WRONG_RANK_HISTORY,
                   "phases": [{"name": "skipped", "workload": "shared_prefixes", "fault": SKIPPED_HISTORY}]},
        "off": {"args": plain, "mode3": "eager", **shared},
        "on": {"kvpp": True, "args": plain, "mode3": "eager", **shared},
    }
    return run_engines(tiny_deepseek, variants)


def _streamed_pairs(runs):
    return [("MTP, eager", runs["mtp-off"], runs["mtp-on"], 1.5), ("mode 3", runs["off"], runs["on"], 1.7)]


def test_chunked_prefill_prefix_caching_and_mtp_keep_compact_slots_with_the_tokens_of_kvpp_off(streamed_runs):
    """vLLM's defaults keep compact slots: later chunks, prefix hits and CPU_MLA's verification rows read
    their history from chunks the owners stream; the tokens of KVPP off over two waves, and at least
    1.5x the blocks of KVPP off with MTP (one local draft layer next to 3 owned), 1.7x without."""
    for name, off, on, ratio in _streamed_pairs(streamed_runs):
        mtp = "MTP" in name
        assert on["config"]["chunked_prefill"] and on["config"]["prefix_caching"], name
        assert on["config"]["max_num_batched_tokens"] == 128 and on["config"]["mode"] == (0 if mtp else 3)
        assert on["tokens"] == off["tokens"] and len(on["tokens"]) == 3, name
        assert all(len(t) == (8 if mtp else 16) for t in on["tokens"]) and len(set(on["tokens"][1])) > 1, name
        if not mtp:  # KVPP's pass rewrote the whole graph before vLLM's split
            assert on["config"]["backend"] == "eager" and on["config"]["kvpp_fx"], on["config"]
            for stats in on["stats"]:
                graphs = {(g["kind"], tuple(g["layers"])) for g in stats["compiled_graphs"]}
                assert ("target", tuple(range(NUM_LAYERS))) in graphs, graphs
        assert on["prefix_cache_hits"] == off["prefix_cache_hits"] >= 288, name  # 18 blocks of the shared prefix
        assert on["num_blocks"][0] >= ratio * off["num_blocks"][0], (name, on["num_blocks"], off["num_blocks"])
        for stats in on["stats"]:
            assert (stats["scratch_blocks"], stats["compact_blocker"], stats["streams_history"]) == (40, None, True)
            assert stats["prefill_rows_with_history"] > 0 and stats["context_chunks"] > 0, (name, stats)
            assert stats["packed_layers"] > 0, (name, stats)


def _history_bytes(schedule: list) -> int:
    """The history bytes each rank streams over a run, from vLLM's scheduler (`vllm_checks._schedule_recorder`):
    CPU_MLA runs a request's rows as a prefill row when the step schedules it more than one token (its
    metadata builder's decode threshold is 1; MTP's verification rows are 2), and such a row reads all the
    request's computed tokens as history, in chunks through the context workspace. Each target layer
    streams each chunk once, recorded on every rank: its tokens' latent rows, 576 float32 values each.
    The MTP layer is local: its history never streams."""
    tokens = sum(computed for step in schedule for computed, scheduled in step if computed > 0 and scheduled > 1)
    return tokens * 576 * 4 * NUM_LAYERS


def test_streamed_history_moves_what_it_reads_never_whole_layers(streamed_runs):
    """Bytes: the streamed chunks are exactly the history vLLM's scheduler had the prefill rows read, 576
    float32 values per token and target layer (`_history_bytes`). With MTP on CPU_MLA every row after a
    prompt's prefill is a verification row, which CPU_MLA runs as a prefill row: no prefill row takes a
    slot position, so nothing is broadcast into the slots at all and every byte moved is streamed history
    (a prefill row listing its history blocks would broadcast them). Without MTP the decode rows read
    their blocks from the slots, at most S blocks per layer and forward."""
    page = 16 * 576 * 4 + 8  # a block of one layer, with its id
    mtp, plain = streamed_runs["mtp-on"], streamed_runs["on"]
    for run in (mtp, plain):  # the history read: later chunks, prefix hits (>= 288 tokens), verification rows
        assert _history_bytes(run["schedule"]) > 288 * 576 * 4 * NUM_LAYERS, run["schedule"]
        for stats in run["stats"]:
            assert stats["context_bytes"] == _history_bytes(run["schedule"]), (stats, run["schedule"])
    for stats in mtp["stats"]:
        assert stats["broadcasts"] == 0 and stats["exchanges"] == 0 and stats["bytes"] == stats["context_bytes"], stats
    for stats in plain["stats"]:
        assert stats["broadcasts"] > 0 and stats["exchanges"] == 0, stats
        assert 0 < stats["bytes"] - stats["context_bytes"] <= stats["broadcasts"] * 40 * page, stats
    for run in (mtp, plain):  # prefetched: every chunk but each streaming step's first (or each layer's first)
        steps = sum(any(computed > 0 and scheduled > 1 for computed, scheduled in step) for step in run["schedule"])
        for stats in run["stats"]:
            assert 0 < stats["context_ahead"] and \
                stats["context_chunks"] - steps * NUM_LAYERS <= stats["context_ahead"], (stats, steps)
            assert stats["context_ahead"] <= stats["context_chunks"] - steps, (stats, steps)


def test_history_chunks_from_the_wrong_rank_or_none_change_the_tokens(streamed_runs):
    """Each faulty run streamed the history it read (`_history_bytes` of its own steps), and its fault
    acted on every chunk, counted below the fault (`counted_faults`): each broadcast from the rank after
    the owner, then none issued at all."""
    on = streamed_runs["mtp-on"]
    skipped = on["phases"]["skipped"]
    assert on["faulty"] != on["tokens"] and skipped["tokens"] != on["tokens"]
    faulty = ((on["faulty_stats"], on["faulty_counts"], on["faulty_schedule"], WRONG_RANK_HISTORY, "wrong_rank"),
              (skipped["stats"], skipped["fault_counts"], skipped["schedule"], SKIPPED_HISTORY, "skipped"))
    for ranks_stats, ranks_counts, schedule, fault, acted in faulty:
        for stats, counts in zip(ranks_stats, ranks_counts, strict=True):
            assert stats["device_api"] == fault and stats["context_chunks"] > 0, stats
            assert stats["context_bytes"] == _history_bytes(schedule) > 0, (stats, schedule)
            chunks = stats["context_chunks"]  # every chunk, on every rank
            assert counts[fault.rpartition(":")[2]] == {"history_chunks": chunks, acted: chunks}, counts


@pytest.fixture(scope="module")
def triton_streamed_runs(tiny_deepseek):
    """TRITON_MLA (its Triton decode kernel interpreted, `triton_mla_on_cpu`) with MTP and chunked prefill
    and prefix caching on, eager: its metadata takes MTP's verification rows as decode rows (two queries
    each), which read compact slots by broadcast in "auto" and go to their owners in owner mode; later
    chunks and prefix hits stream. KVPP off, then on ("auto", then owner mode)."""
    env = {**CHUNKED_ENV, triton_mla_on_cpu.ENV: "1"}
    args = {**HISTORY_ROWS, **EAGER, "attention_backend": "TRITON_MLA",
            "speculative_config": {**MTP, "attention_backend": "TRITON_MLA"}}
    eight = {"max_tokens": 8}  # the interpreted decode kernel costs per step: fewer steps
    common = {"args": args, "env": env, "workload": "shared_prefixes", "sampling": eight}
    variants = {"off": common,
                "on": {"kvpp": True, **common, "phases": [{"name": "owner", "mode": "owner",
                                                           "workload": "shared_prefixes"}]}}
    return run_engines(tiny_deepseek, variants)


def test_triton_mla_with_mtp_and_chunked_prefill_keeps_compact_slots_with_the_tokens_of_kvpp_off(
        triton_streamed_runs):
    off, on = triton_streamed_runs["off"], triton_streamed_runs["on"]
    assert on["config"]["chunked_prefill"] and on["config"]["prefix_caching"] and on["config"]["model_runner"] == "V2"
    assert on["tokens"] == off["tokens"] and len(set(off["tokens"][1])) > 1
    assert on["prefix_cache_hits"] == off["prefix_cache_hits"] >= 288
    assert on["num_blocks"][0] >= 1.5 * off["num_blocks"][0], (on["num_blocks"], off["num_blocks"])
    for stats in on["stats"]:
        assert stats["attention_backends"] == ["TRITON_MLA"] and stats["compact_blocker"] is None, stats
        assert stats["context_chunks"] > 0 and stats["broadcasts"] > 0, stats  # verification rows read by broadcast
    owner = on["phases"]["owner"]
    assert owner["tokens"] == off["tokens"]
    for stats in owner["stats"]:  # each verification step's two queries per request ran on the owners
        assert stats["exchanges"] > 0 and stats["rows"]["owner"] > 0 and stats["context_chunks"] > 0, stats


@pytest.fixture(scope="module")
def platform_backend_runs(tiny_deepseek):
    """vLLM CPU's own choice of MLA backend, in bfloat16 with MTP, eager, with chunked prefill and prefix
    caching on, a 256-token budget and 8 tokens a request: AMX_MLA on AMX hosts (block 128; vLLM keeps
    both on), CPU_MLA elsewhere (block 16; both restored by `cpu_chunked_prefill`). Prompts sharing a
    300-token prefix, longer than the budget, in two waves (the second hits the first's prefix). The
    negative control fits the path the history takes: broadcast whole-layer or packed slots on AMX_MLA
    (read through tables as given), streamed from the owners on CPU_MLA (broadcast from the wrong rank)."""
    common = {"dtype": "bfloat16", "speculative_config": MTP, "max_num_batched_tokens": 256,
              "enable_chunked_prefill": True, "enable_prefix_caching": True, **EAGER}
    fault = FAULT if HOST_HAS_AMX else WRONG_RANK_HISTORY
    shared = {"env": CHUNKED_ENV, "workload": "shared_prefixes", "sampling": {"max_tokens": 8}}
    variants = {"off": {"args": common, **shared}, "on": {"kvpp": True, "args": common, **shared, "fault": fault}}
    return run_engines(tiny_deepseek, variants)


def test_the_platforms_own_mla_backend_gives_the_tokens_of_kvpp_off(platform_backend_runs):
    off, on = platform_backend_runs["off"], platform_backend_runs["on"]
    assert [s["attention_backends"] for s in on["stats"]] == [[PLATFORM_MLA]] * 2
    assert on["config"]["block_size"] == (128 if HOST_HAS_AMX else 16)
    assert on["tokens"] == off["tokens"] and len(on["tokens"]) == 3
    assert all(len(t) == 8 for t in on["tokens"]) and len(set(on["tokens"][1])) > 1
    # The negative control on this backend: the faulty run ran its fault, on the path the fault breaks
    assert on["faulty"] != on["tokens"]
    fault = FAULT if HOST_HAS_AMX else WRONG_RANK_HISTORY
    for stats, counts in zip(on["faulty_stats"], on["faulty_counts"], strict=True):
        assert stats["device_api"] == fault, stats
        if HOST_HAS_AMX:  # tables as given, where the history is broadcast
            assert stats["broadcasts"] > 0, stats
        else:  # every history chunk broadcast from the rank after its owner
            chunks = stats["context_chunks"]
            assert chunks > 0 and counts["WrongRankHistory"] == {"history_chunks": chunks, "wrong_rank": chunks}, counts


def test_chunked_prefill_and_prefix_hits_read_history_from_the_owners(platform_backend_runs):
    """On every host: later chunks and prefix-cache hits read history the other ranks do not hold. AMX_MLA
    (no owner rows) keeps whole-layer slots, into which the history is broadcast; CPU_MLA takes compact
    slots, and the owners stream the history into vLLM's context workspace."""
    on = platform_backend_runs["on"]
    assert on["config"]["chunked_prefill"] and on["config"]["prefix_caching"]
    assert all(s["prefill_rows_with_history"] > 0 for s in on["stats"])
    assert on["tokens"] == platform_backend_runs["off"]["tokens"]
    for stats in on["stats"]:
        if HOST_HAS_AMX:
            assert stats["compact_blocker"] is not None and stats["broadcasts"] > 0, stats
        else:
            assert (stats["compact_blocker"], stats["streams_history"]) == (None, True), stats
            assert stats["context_chunks"] > 0, stats
