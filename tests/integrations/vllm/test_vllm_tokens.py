"""Tokens of KVPP on against KVPP off at TP 2: MTP under vLLM's default compilation (its negative control,
owner mode, the block count, the broadcasts), vLLM's V1 model runner and prefill context parallelism.

Each fixture here starts its engines once, in a check interpreter of its own (`engine_runs`); the
model is the session's tiny DeepSeek-V3 (`conftest.tiny_deepseek`) unless the fixture makes its own.
"""

import pytest

from kvpp_fx.integrations.vllm.setup.compile_modes import KVPP_BACKEND, compile_digest
from tests.integrations.vllm.engine_runs import EAGER, FAULT, FP32, MTP_CPU_MLA, run_engines
from tests.integrations.vllm.tiny_model import NUM_LAYERS

DROPPED_LAYER_2 = "tests.support.faults:dropped_broadcast_of_layer_2"

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def runs(tiny_deepseek):
    """TP 2 with MTP, float32 on CPU_MLA (in bfloat16, inductor and eager round differently and this
    random model's near-tied logits flip): KVPP off (eager), and on under vLLM's default compilation (on
    CPU: mode 2 with inductor; kvpp_mode left to its default, "auto"), which then runs again with
    receivers skipping their scatter (the negative control of its path) and in owner mode. MTP in eager
    mode, with its negative control, is `platform_backend_runs`."""
    common = {**FP32, "speculative_config": MTP_CPU_MLA}
    eight = {"max_tokens": 8}  # CPU_MLA runs each verification row as a prefill row: slow steps
    variants = {
        "off": {"args": {**common, **EAGER}, "sampling": eight},
        "default": {"kvpp": True, "args": common, "sampling": eight, "fault": FAULT,
                    "phases": [{"name": "owner", "mode": "owner"}]},
    }
    return run_engines(tiny_deepseek, variants)


def test_mtp_tokens_identical_with_kvpp(runs):
    off, on = runs["off"], runs["default"]
    assert off["config"]["model_runner"] == on["config"]["model_runner"] == "V2"  # nothing set but enable_kvpp
    assert on["tokens"] == off["tokens"]
    assert all(len(t) == 8 for t in on["tokens"])
    assert len(set(on["tokens"][0])) > 1  # real, varied tokens, not one repeated id
    assert off["stats"] == [None, None]  # KVPP off: no runtime, vLLM's own cache


def test_receivers_reading_unremapped_tables_change_the_tokens(runs):
    """The negative control of the path: non-owners reading their packed slots through vLLM's own block
    tables (pool ids, not packed positions) must show. Without the fault every non-owned layer of every
    forward with packed blocks read remapped metadata."""
    run = runs["default"]
    assert run["faulty"] != run["tokens"] and run["tokens"] == runs["off"]["tokens"]
    assert all(s["device_api"] == FAULT and s["broadcasts"] > 0 for s in run["faulty_stats"])
    for stats in run["stats"]:  # 3 of 6 layers are not owned; every forward after the first packs blocks
        assert stats["packed_layers"] == 3 * (stats["forwards"] - 1), stats


def test_vllms_default_compilation_runs_the_kvpp_pass(runs):
    """Nothing but enable_kvpp: vLLM CPU's default (mode 2 with inductor) compiles through the kvpp
    backend, inductor compiles the pieces, and the tokens are those of KVPP off."""
    run = runs["default"]
    assert (run["config"]["mode"], run["config"]["backend"]) == (2, KVPP_BACKEND)
    assert run["config"]["kvpp_fx"] == {"inner_backend": "inductor", "digest": compile_digest()}
    assert run["tokens"] == runs["off"]["tokens"]
    for stats in run["stats"]:
        graphs = {(g["kind"], tuple(g["layers"])) for g in stats["compiled_graphs"]}
        # The target model's graph gets the plan's ops; the drafter's graph (MTP layer only) none.
        assert graphs == {("target", tuple(range(NUM_LAYERS))), ("draft", (NUM_LAYERS,))}, graphs
        assert stats["broadcasts"] > 0


def test_each_rank_holds_its_own_layers_the_mtp_layer_and_two_scratch(runs):
    for name in ("default",):
        stats = runs[name]["stats"]
        assert [s["persistent_layers"] for s in stats] == [[0, 1, 2, 6], [3, 4, 5, 6]]
        assert [s["draft_layers"] for s in stats] == [[6], [6]]
        assert [s["scratch_buffers"] for s in stats] == [2, 2]
        # vLLM's default model runner here, as wherever Triton runs: V2
        assert [(s["worker_class"], s["runner_class"], s["model_runner"]) for s in stats] == \
            [("KVPPCPUWorker", "KVPPCPUModelRunnerV2", "V2")] * 2
        assert [s["attention_backends"] for s in stats] == [["CPU_MLA"]] * 2


def test_vllm_plans_the_kvpp_block_count(runs):
    """32 MiB per rank: 3 owned + 1 MTP buffers of n blocks (16 x 576 x 4 B each) and 2 whole-layer
    scratch slots of n blocks with an 8-byte id each, every buffer 2 MiB aligned; nothing else. Compact
    slots could run here (MTP's verification rows stream their history), but slots of the model's 1024
    tokens plus vLLM CPU's budget hold no more blocks in 32 MiB, and a tie keeps whole-layer slots
    (`scratch.choose_plan`)."""
    page, budget, align = 16 * 576 * 4, 32 << 20, 2 << 20

    def padded(nbytes):
        return -(-nbytes // align) * align

    def cost(n):
        return 4 * padded(n * page) + 2 * padded(n * (page + 8))

    expected = max(n for n in range(1, budget // page + 1) if cost(n) <= budget)
    assert runs["default"]["num_blocks"] == [expected, expected]
    assert [s["allocated_bytes"] for s in runs["default"]["stats"]] == [cost(expected)] * 2
    assert runs["off"]["num_blocks"][0] == budget // (7 * page)  # replicated: 6 layers + MTP, unpadded
    for stats in runs["default"]["stats"]:
        assert stats["scratch_blocks"] is None and stats["slot_blocks"] == expected
        assert stats["compact_blocker"] is None and stats["streams_history"]


def test_broadcasts_on_decode_steps_never_on_the_first_prefill(runs):
    for stats in runs["default"]["stats"]:
        assert stats["per_layer"].keys() == {str(i) for i in range(NUM_LAYERS)}  # never the MTP layer
        assert stats["forwards"] >= 8
        # Every forward with history moves all 6 layers; the first prefill moves none.
        assert stats["broadcasts"] == NUM_LAYERS * (stats["forwards"] - 1)
        # Only the blocks holding computed tokens move (2 requests of at most 106 tokens: 14 blocks),
        # not whole layers.
        whole_layer = stats["num_blocks"] * 16 * 576 * 4
        assert stats["bytes"] <= stats["broadcasts"] * 14 * (16 * 576 * 4 + 8) < stats["broadcasts"] * whole_layer


def test_mtp_verification_rows_on_cpu_mla_take_the_broadcast_path(runs):
    """MTP verification rows are 2 tokens per request; CPU_MLA decodes one query per request, so vLLM runs
    them as prefill rows with history: owner mode (and auto) sends none of them to the owner and
    broadcasts their blocks, with the tokens of KVPP off. (Backends that decode several tokens per
    request, TRITON_MLA among them, count them as decode rows.)"""
    owner = runs["default"]["phases"]["owner"]
    assert owner["tokens"] == runs["off"]["tokens"]
    for stats in owner["stats"]:
        assert stats["kvpp_mode"] == "owner" and stats["exchanges"] == 0 and stats["rows"]["owner"] == 0
        assert stats["broadcasts"] > 0
    for stats in runs["default"]["stats"]:  # auto, the default
        assert stats["kvpp_mode"] == "auto" and stats["exchanges"] == 0 and stats["broadcasts"] > 0


@pytest.fixture(scope="module")
def runner_runs(tiny_deepseek):
    """In one interpreter: vLLM's V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``; deprecated, still shipped by
    vLLM 0.32) at TP 2, and prefill context parallelism (V2 only) at PCP 2 x TP 1, so the KVPP group is the
    two PCP ranks; float32 on CPU_MLA, eager, KVPP off and on each, then a negative control on each KVPP
    engine: V1's receivers read their packed slots through vLLM's own tables; PCP's owner of layer 2
    broadcasts zeros."""
    v1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    common = {**FP32, **EAGER}
    pcp = {**common, "tensor_parallel_size": 1, "prefill_context_parallel_size": 2}
    variants = {"v1-off": {"args": common, "env": v1},
                "v1-on": {"kvpp": True, "args": common, "env": v1, "fault": FAULT},
                "pcp-off": {"args": pcp},
                "pcp-on": {"kvpp": True, "args": pcp, "fault": DROPPED_LAYER_2}}
    return run_engines(tiny_deepseek, variants)


def test_the_v1_model_runner_gives_the_tokens_of_kvpp_off(runner_runs):
    off, on = runner_runs["v1-off"], runner_runs["v1-on"]
    assert off["config"]["model_runner"] == on["config"]["model_runner"] == "V1"
    assert on["tokens"] == off["tokens"] and len(set(on["tokens"][0])) > 1
    for stats in on["stats"]:
        assert (stats["runner_class"], stats["model_runner"]) == ("KVPPCPUModelRunner", "V1")
        assert stats["broadcasts"] == NUM_LAYERS * (stats["forwards"] - 1) and stats["packed_layers"] > 0, stats
    assert on["faulty"] != on["tokens"]
    assert all(s["device_api"] == FAULT for s in on["faulty_stats"])


def test_pcp_groups_give_the_tokens_of_kvpp_off(runner_runs):
    """Each PCP rank computes its part of a prompt; the step's history comes from the PCP manager's global
    batch, the same on both ranks, and every layer travels whole (each rank's metadata holds only its part
    of the batch, so nothing is remapped), and decode rows stay on broadcast."""
    off, on = runner_runs["pcp-off"], runner_runs["pcp-on"]
    assert on["config"]["model_runner"] == "V2"
    assert on["tokens"] == off["tokens"] and len(set(on["tokens"][0])) > 1
    assert [s["owned_layers"] for s in on["stats"]] == [[0, 1, 2], [3, 4, 5]]
    page = 16 * 576 * 4
    for stats in on["stats"]:
        assert "prefill context parallelism" in stats["owner_blocker"] and stats["packed_layers"] == 0
        assert stats["broadcasts"] == NUM_LAYERS * (stats["forwards"] - 1) > 0 and stats["exchanges"] == 0
        assert stats["bytes"] == stats["broadcasts"] * stats["num_blocks"] * page, stats  # whole layers
    assert on["faulty"] != on["tokens"]  # layer 2's owner (rank 0) sent zeros for it, as whole layers
    for stats in on["faulty_stats"]:  # the faulty run's runtime: it broadcast every layer whole in every step
        assert stats["device_api"] == DROPPED_LAYER_2 and stats["packed_layers"] == 0, stats
        assert stats["broadcasts"] == NUM_LAYERS * (stats["forwards"] - 1) > 0, stats
