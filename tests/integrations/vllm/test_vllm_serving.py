"""Online serving: vLLM's OpenAI server at TP 2 with KVPP on gives KVPP off's text (vLLM's default engine-core
process, its own workers), and its negative control.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integrations.vllm.engine_runs import ENV, FAULT, ROOT
from tests.integrations.vllm.tiny_model import NUM_LAYERS

pytestmark = pytest.mark.vllm


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
