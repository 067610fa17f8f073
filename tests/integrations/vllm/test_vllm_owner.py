"""Owner mode and compact slots in vLLM engines: decode rows on their owners (eager, mode 3, TRITON_MLA),
the bytes they move, mixed steps, the slots' block count, steps wider than a slot, vLLM's block zeroer
and V2's warm-up, and the negative controls.

Each fixture here starts its engines once, in a check interpreter of its own (`engine_runs`); the
model is the session's tiny DeepSeek-V3 (`conftest.tiny_deepseek`) unless the fixture makes its own.
"""

import pytest

from kvpp_fx.integrations.vllm.setup.compile_modes import compile_digest
from tests.integrations.vllm import triton_mla_on_cpu
from tests.integrations.vllm.engine_runs import (
    CHUNKED_ENV,
    EAGER,
    NO_HISTORY_ROWS,
    OWNER_BYTES_PER_TOKEN,
    SKIPPED_GATHER,
    SWAPPED_HEADS,
    run_engines,
)
from tests.integrations.vllm.tiny_model import NUM_LAYERS

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def owner_runs(tiny_deepseek):
    """TP 2 without MTP, float32 on CPU_MLA, the staggered workload (a 700-token prompt, then two short
    ones that prefill next to its decode rows: a mixed step), then more phases on each engine: KVPP off;
    eager with kvpp_mode left to "auto", then in broadcast mode, on compact slots of 48 blocks
    (kvpp_scratch_blocks); mode 3 (`cpu_mode3`, inductor pieces) on "auto", then in broadcast and in
    owner mode. (Mode 2, vLLM CPU's default compilation, runs the same exchange below the graph, in
    ``forward_mqa``; its engines are `runs`.) Every KVPP engine here
    has compact slots: no row but a decode reads history (`NO_HISTORY_ROWS`), and mode 3 on the slots its
    max_model_len and token budget give (176 blocks). Faults: on mode 3, the owner
    scattering each rank the next rank's heads (SwappedHeads), and no gather at all, so the owner uses
    its own queries for every rank's heads (SkippedGather, on `triton_runs`)."""
    staggered = NO_HISTORY_ROWS
    variants = {
        "off": {"args": {**staggered, **EAGER}, "workload": "staggered",
                "phases": [{"name": "many-short", "workload": "many_short"}]},
        "eager": {"kvpp": True, "workload": "staggered",
                  "args": {**staggered, **EAGER, "additional_config": {"enable_kvpp": True, "kvpp_scratch_blocks": 48}},
                  "zero_blocks": [1, 200], "v2_warm_up": True, "phases": [
            {"name": "broadcast", "mode": "broadcast", "workload": "staggered"},
            {"name": "many-short", "mode": "broadcast", "workload": "many_short"}]},
        "mode3": {"kvpp": True, "mode3": True, "args": staggered, "workload": "staggered", "phases": [
            {"name": "broadcast", "mode": "broadcast", "workload": "staggered"},
            {"name": "owner", "mode": "owner", "workload": "staggered"},
            {"name": "swapped-heads", "mode": "owner", "workload": "staggered", "fault": SWAPPED_HEADS}]},
    }
    return run_engines(tiny_deepseek, variants)


def _owner_path_runs(owner_runs):
    """(name, run, reference tokens) of every run that sent decode rows to the owner."""
    off = owner_runs["off"]
    return [("eager auto", owner_runs["eager"], off["tokens"]),
            ("mode 3 auto", owner_runs["mode3"], off["tokens"]),
            ("mode 3 owner", owner_runs["mode3"]["phases"]["owner"], off["tokens"])]


def test_owner_and_auto_give_the_tokens_of_kvpp_off(owner_runs):
    off = owner_runs["off"]
    assert len(off["tokens"]) == 3 and all(len(t) == 16 for t in off["tokens"]) and len(set(off["tokens"][0])) > 1
    for name, run, reference in _owner_path_runs(owner_runs):
        assert run["tokens"] == reference, name
        for stats in run["stats"]:
            assert stats["model_runner"] == "V2", (name, stats["model_runner"])
            assert stats["exchanges"] > 0 and stats["rows"]["owner"] > 0, (name, stats)
            # each rank owns 3 of the 6 layers and skips the other 3's writes when decode rows go to the owner
            assert stats["skipped_cache_writes"] > 0, (name, stats)
    assert owner_runs["mode3"]["phases"]["broadcast"]["tokens"] == off["tokens"]


def test_owner_mode_moves_bytes_independent_of_context(owner_runs):
    """In owner mode no block moves: each decode token costs the formula's bytes per layer, whatever its
    history (700 tokens here); broadcast mode moves the history."""
    owner = owner_runs["mode3"]["phases"]["owner"]["stats"]
    broadcast = owner_runs["mode3"]["phases"]["broadcast"]["stats"]
    for stats in owner:
        assert stats["kvpp_mode"] == "owner" and stats["broadcasts"] == 0
        assert stats["bytes"] == stats["rows"]["owner"] * OWNER_BYTES_PER_TOKEN * NUM_LAYERS, stats
    for o, b in zip(owner, broadcast):
        assert b["bytes"] > 50 * o["bytes"], (o["bytes"], b["bytes"])


def test_mixed_steps_route_decode_rows_to_the_owner_next_to_a_prefill(owner_runs):
    for name, run, _ in _owner_path_runs(owner_runs):
        for stats in run["stats"]:
            assert stats["mixed_steps"] >= 1 and stats["modes"]["hybrid"] >= 1, (name, stats)
    # "auto" weighs the step: the long prompt's decodes go to the owner; the first prefill reads nothing.
    auto = owner_runs["eager"]["stats"][0]
    assert auto["kvpp_mode"] == "auto" and auto["modes"]["owner"] > auto["modes"]["broadcast"]


def test_compact_slots_hold_the_plans_block_count(owner_runs):
    """vLLM CPU runs CPU_MLA with a token budget of max(max_model_len, 2048): with a max model length of
    768 in blocks of 16 mode 3's slots hold 48 + 128 = 176 blocks; the eager engine fixes 48
    (kvpp_scratch_blocks). 64 MiB per rank: 3 owned buffers of n blocks (16 x 576 x 4 B each) and two
    slots of S blocks behind a 4 KiB ids region, every buffer 2 MiB aligned; nothing else. Whole-layer
    slots would hold fewer (341 blocks)."""
    page, budget, align = 16 * 576 * 4, 64 << 20, 2 << 20

    def padded(nbytes):
        return -(-nbytes // align) * align

    def cost(n, slot):
        return 3 * padded(n * page) + 2 * padded(-(-slot * 8 // 4096) * 4096 + slot * page)

    def most(fits):
        return max(n for n in range(1, budget // page + 1) if fits(n))

    whole = most(lambda n: 3 * padded(n * page) + 2 * padded(4096 + n * page) <= budget)
    config = owner_runs["mode3"]["config"]
    assert (config["max_model_len"], config["max_num_batched_tokens"], config["block_size"]) == (768, 2048, 16)
    derived = -(-768 // 16) + -(-2048 // 16)
    for name, slot in (("eager", 48), ("mode3", derived)):
        run = owner_runs[name]
        expected = most(lambda n: cost(n, slot) <= budget)
        assert expected > whole, (expected, whole)
        assert run["num_blocks"] == [expected, expected], name
        for stats in run["stats"]:
            assert (stats["scratch_blocks"], stats["slot_blocks"], stats["compact_blocker"]) == (slot, slot, None)
            assert (stats["num_blocks"], stats["allocated_bytes"]) == (expected, cost(expected, slot)), name
            assert stats["packed_layers"] > 0, name


def test_steps_wider_than_a_compact_slot_send_their_decode_rows_to_the_owners(owner_runs):
    """Broadcast mode on slots of 48 blocks: once the two short prompts decode next to the long one, the
    step reads 45 + 8 + 7 blocks, more than a slot holds, and its decode rows go to their owners (owner-mode
    forwards); the long prompt's first decodes (46 blocks) still broadcast. Tokens: KVPP off's. The
    control: the same workload and mode on slots of 176 blocks (mode 3) never goes to the owners."""
    off = owner_runs["off"]["tokens"]
    phase = owner_runs["eager"]["phases"]["broadcast"]
    assert phase["tokens"] == off
    for stats in phase["stats"]:
        assert stats["kvpp_mode"] == "broadcast" and stats["slot_blocks"] == 48
        assert stats["modes"]["owner"] > 0 and stats["modes"]["broadcast"] > 0 and stats["exchanges"] > 0, stats
    wide = owner_runs["mode3"]["phases"]["broadcast"]
    assert wide["tokens"] == off
    for stats in wide["stats"]:
        assert stats["slot_blocks"] == 176 and stats["modes"]["owner"] == 0 and stats["exchanges"] == 0, stats


def test_a_step_of_many_fresh_prompts_packs_nothing_into_a_compact_slot(owner_runs):
    """20 prompts of 33 tokens prefill in one step and write 60 blocks, more than the 48 a slot holds:
    prefill rows without history take no slot positions, so that step packs nothing; their decodes
    (60 blocks of history, then more) go to the owners in broadcast mode. Tokens: KVPP off's."""
    phase = owner_runs["eager"]["phases"]["many-short"]
    off = owner_runs["off"]["phases"]["many-short"]["tokens"]
    assert len(off) == 20 and phase["tokens"] == off
    for stats in phase["stats"]:
        assert stats["slot_blocks"] == 48 and stats["modes"]["owner"] > 0, stats


def test_block_zeroer_leaves_compact_slots_alone(owner_runs):
    """vLLM's zeroer of freshly allocated blocks, on the engine with slots of 48 blocks: blocks 1 and 200
    are zeroed in the persistent views, the slots keep their bytes (position 1 included). The control:
    vLLM's own V2 zeroer, built over every view, refuses the 48-block slot views (it asserts every view
    holds the pool's blocks)."""
    for probe in owner_runs["eager"]["zero_blocks"]:
        assert probe == {"persistent_zeroed": True, "slots_untouched": True, "slot_blocks": 48,
                         "model_runner": "V2", "vllm_own": "AssertionError"}, probe


def test_v2s_gpu_warm_up_steps_run_as_kvpp_steps(owner_runs):
    """vLLM's V2 warm-up on a GPU schedules real requests on real block ids from inside the worker's
    ``compile_or_warm_up_model``, where dummy runs pass through. Driven on the engine with slots of 48
    blocks (`vllm_checks.v2_warm_up`), its steps open KVPP forwards on both ranks and reach block ids past
    a slot's end: in passthrough a non-owned layer would index outside its slot (an IndexError in
    CPU_MLA's cache write here, an unchecked write on a GPU). The phases run after it give the tokens of
    KVPP off."""
    results = owner_runs["eager"]["v2_warm_up"]
    assert len(results) == 2 and results[0]["forwards"] == results[1]["forwards"] >= 4, results
    for result in results:
        assert result["slot_blocks"] == 48 and result["max_block_id"] >= 48, result
    off = owner_runs["off"]
    assert owner_runs["eager"]["phases"]["broadcast"]["tokens"] == off["tokens"]
    assert owner_runs["eager"]["phases"]["many-short"]["tokens"] == off["phases"]["many-short"]["tokens"]


def test_owner_mode_negative_controls_change_the_tokens(owner_runs):
    off = owner_runs["off"]["tokens"]
    run = owner_runs["mode3"]["phases"]["swapped-heads"]  # the exchange runs below the graph: one control
    assert run["tokens"] != off                              # serves eager and mode 3
    assert all(s["exchanges"] > 0 and s["device_api"] for s in run["stats"])


def test_mode_3_runs_the_pass_before_vllms_split(owner_runs):
    """Mode 3 (vLLM's CUDA default) on the CPU stand-in: KVPP's VllmBackend rewrites the whole graph,
    vLLM splits it at its splitting ops plus the kvpp ops, inductor compiles the pieces, vLLM's
    generated code runs the kvpp ops inline; the tokens are those of KVPP off, in both modes."""
    run = owner_runs["mode3"]
    assert run["config"]["mode"] == 3 and run["config"]["backend"] == "inductor"
    assert run["config"]["splitting_ops"][-2:] == ["kvpp::prefetch", "kvpp::wait"]
    assert "vllm::unified_mla_attention_with_output" in run["config"]["splitting_ops"]
    assert run["config"]["kvpp_fx"] == {"digest": compile_digest()}
    broadcast = run["phases"]["broadcast"]
    assert broadcast["tokens"] == owner_runs["off"]["tokens"]
    for stats in broadcast["stats"]:
        assert ("target", tuple(range(NUM_LAYERS))) in {(g["kind"], tuple(g["layers"]))
                                                        for g in stats["compiled_graphs"]}
        assert stats["broadcasts"] == NUM_LAYERS * (stats["forwards"] - 1)


@pytest.fixture(scope="module")
def triton_runs(tiny_deepseek):
    """TRITON_MLA, a CUDA user's MLA kernel, on V2 at TP 2: selected on vLLM CPU by test code
    (`triton_mla_on_cpu`: the platform's choice, CPU_MLA's cache write, float32), its Triton decode kernel
    interpreted, with vLLM's defaults (chunked prefill and prefix caching on, `cpu_chunked_prefill`) and a
    128-token budget, so the staggered workload's 700-token prompt prefills in chunks whose history streams
    from the owners. KVPP off; on with compact slots of 48 + 8 blocks in "auto" on the staggered workload,
    then in owner mode, then with no gather issued, so the owner uses its own queries for every rank's heads
    (the negative control)."""
    env = {triton_mla_on_cpu.ENV: "1", **CHUNKED_ENV}
    args = {**NO_HISTORY_ROWS, **EAGER, "attention_backend": "TRITON_MLA", "enable_chunked_prefill": True,
            "enable_prefix_caching": True, "max_num_batched_tokens": 128}
    eight = {"max_tokens": 8}  # the interpreted decode kernel costs per step: fewer steps
    variants = {
        "off": {"args": args, "env": env, "workload": "staggered", "sampling": eight,
                "phases": [{"name": "short", "workload": "short"}]},
        "on": {"kvpp": True, "args": args, "env": env, "workload": "staggered", "sampling": eight, "phases": [
            {"name": "owner", "mode": "owner", "workload": "short"},
            {"name": "skipped-gather", "mode": "owner", "workload": "short", "fault": SKIPPED_GATHER}]},
    }
    return run_engines(tiny_deepseek, variants)


def test_triton_mla_decode_rows_go_to_their_owners_with_the_tokens_of_kvpp_off(triton_runs):
    """Owner calls over both ranks' heads run TRITON_MLA's own forward_mqa and kernel: "auto" sends the long
    prompt's decodes to the owners, owner mode every decode; compact slots (the backend is owner-capable);
    the tokens of KVPP off. The control: no gather, so the owner computes every rank's heads from its own."""
    off, on = triton_runs["off"], triton_runs["on"]
    assert len(off["tokens"]) == 3 and len(set(off["tokens"][0])) > 1
    for name, run, reference in (("auto", on, off["tokens"]),
                                 ("owner", on["phases"]["owner"], off["phases"]["short"]["tokens"])):
        assert run["tokens"] == reference, name
        for stats in run["stats"]:
            assert stats["attention_backends"] == ["TRITON_MLA"] and stats["model_runner"] == "V2", stats
            assert stats["owner_blocker"] is None and stats["exchanges"] > 0 and stats["rows"]["owner"] > 0, \
                (name, stats)
    assert on["config"]["chunked_prefill"] and on["config"]["prefix_caching"]
    # vLLM's defaults without MTP: at least 1.7x the blocks of KVPP off (MTP: `triton_streamed_runs`)
    assert on["num_blocks"][0] >= 1.7 * off["num_blocks"][0], (on["num_blocks"], off["num_blocks"])
    for stats in on["stats"]:
        assert (stats["scratch_blocks"], stats["compact_blocker"]) == (-(-768 // 16) + -(-128 // 16), None)
        assert stats["packed_layers"] > 0 and stats["modes"]["owner"] > 0 and stats["context_chunks"] > 0
    faulty = on["phases"]["skipped-gather"]
    assert faulty["tokens"] != off["phases"]["short"]["tokens"] and all(s["exchanges"] > 0 for s in faulty["stats"])


@pytest.fixture(scope="module")
def triton_fp8_runs(tiny_deepseek):
    """TRITON_MLA with an fp8 KV cache (``kv_cache_dtype="fp8"``, e4m3 bytes; vLLM CPU's own MLA backends have
    none) on V2 at TP 2, float32 queries, its Triton decode kernel interpreted (`triton_mla_on_cpu`, whose fp8
    cache write follows ``concat_and_cache_mla``'s). Fresh short prompts only (`NO_HISTORY_ROWS`): every
    row that reads the cache is a decode row. KVPP off; on in "auto", then in owner mode, then in owner mode
    with no gather issued (the owner uses its own queries for every rank's heads: the negative control)."""
    env = {triton_mla_on_cpu.ENV: "1"}
    args = {**NO_HISTORY_ROWS, **EAGER, "attention_backend": "TRITON_MLA", "kv_cache_dtype": "fp8"}
    eight = {"max_tokens": 8}
    variants = {
        "off": {"args": args, "env": env, "sampling": eight},
        "on": {"kvpp": True, "args": args, "env": env, "sampling": eight, "phases": [
            {"name": "owner", "mode": "owner"},
            {"name": "skipped-gather", "mode": "owner", "fault": SKIPPED_GATHER}]},
    }
    return run_engines(tiny_deepseek, variants)


def test_an_fp8_kv_cache_keeps_decode_rows_on_their_owners_with_the_tokens_of_kvpp_off(triton_fp8_runs):
    """An fp8 cache: one byte per cached value on every rank (vLLM's caches hold 576 bytes per token and
    layer), owner mode sends every decode row to its layer's owner, which runs TRITON_MLA's kernel over the
    fp8 cache for both ranks' heads; the tokens equal KVPP off's, in "auto" and in owner mode; 1.5x the
    blocks of KVPP off. The control: no gather changes the tokens."""
    off, on = triton_fp8_runs["off"], triton_fp8_runs["on"]
    assert len(off["tokens"]) == 2 and len(set(off["tokens"][0])) > 1
    blocks_off, blocks_on = off["num_blocks"][0], on["num_blocks"][0]
    assert off["kv_cache_bytes"] == [blocks_off * 16 * 576 * NUM_LAYERS] * 2, (off["kv_cache_bytes"], blocks_off)
    assert blocks_on >= 1.5 * blocks_off, (blocks_on, blocks_off)
    owner = on["phases"]["owner"]
    assert on["tokens"] == off["tokens"] and owner["tokens"] == off["tokens"]
    for stats in owner["stats"]:
        assert stats["attention_backends"] == ["TRITON_MLA"] and stats["owner_blocker"] is None, stats
        assert stats["rows"]["owner"] > 0 and stats["exchanges"] > 0 and stats["modes"]["owner"] > 0, stats
    faulty = on["phases"]["skipped-gather"]
    assert faulty["tokens"] != off["tokens"] and all(s["exchanges"] > 0 for s in faulty["stats"])
