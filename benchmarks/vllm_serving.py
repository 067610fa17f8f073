"""What KVPP buys a vLLM user: more requests held in the same KV memory, through vLLM's OpenAI server.

    python benchmarks/vllm_serving.py [--layers 16] [--kv-memory 48MiB] [--requests 16] [--input-len 500]
    python benchmarks/vllm_serving.py --model deepseek-v4 [--kv-memory 16MiB]

A tiny random DeepSeek-V3 with 16 layers (16 / (8 + 2) = 1.6x the blocks at TP 2 in theory, less the
2 MiB padding) is served at TP 2 with a fixed ``--kv-cache-memory-bytes``, KVPP
off and then on, each driven by vLLM's own benchmark client (``vllm bench serve``, whose module runs
here: the CPU wheel's ``vllm`` script does not start) with more concurrent long-prompt requests than
KVPP off can hold. The servers run vLLM's default model runner, V2, its Triton kernels under Triton's
interpreter (``tests/integrations/vllm/serve.py``). Both servers run eagerly in bfloat16 on the attention
backends vLLM picks (the KVPP server reports its own), so that only KVPP differs. Reported, off and on: vLLM's
block count and KV capacity in tokens as vLLM reports them (``vllm:cache_config_info``),
the most requests running at once and the preemptions (vLLM's ``/metrics``, sampled while the client
runs), output throughput, TTFT and TPOT medians, and whether the greedy outputs are equal where both
servers run the same batches (under load they do not: vLLM's numerics depend on the batch), each from an
empty prefix cache (after the load, a server with more KV memory keeps more prefixes cached). The tiny
tokenizer decodes every id of the model's vocabulary, so equal texts are equal tokens.

``--model deepseek-v4`` serves the tests' tiny random DeepSeek-V4 instead (`tiny_model.TINY_DEEPSEEK_V4`: ratios
0, 4, 128 and 4, every row of a layer on its owner with KVPP), with the tests' shims in every server process
(`deepseek_v4_on_cpu`: vLLM 0.32's window-metadata bug, seeded dummy weights alike in both servers), and writes
``vllm_serving_deepseek_v4``. Its prompts are shorter than the index top-k (512 compressed rows, 2,048 tokens)
allows within the KV memory at hand, so its indexers keep every compressed row: the engine tests cover their
selection (`test_vllm_deepseek_v4.py`). vLLM's capacity in tokens is not V4's (its block size there is the
compressor states' 4 tokens); the ratio is of vLLM's blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _common import write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvpp_fx.cli.byte_sizes import parse_bytes  # noqa: E402
from tests.integrations.vllm.deepseek_v4_on_cpu import ENV as DEEPSEEK_V4_ENV  # noqa: E402
from tests.integrations.vllm.tiny_model import (  # noqa: E402
    TINY_DEEPSEEK_V4, make_tiny_deepseek, make_tiny_deepseek_v4_config)

TINY_DEEPSEEK_V4_LAYERS = TINY_DEEPSEEK_V4["num_hidden_layers"]

# Per model: the result's name, the default KV memory per rank and prompt length (KVPP off then holds under half
# of the 16 requests), and what the servers add to vLLM's arguments and environment. vLLM sizes V4's
# smallest KV memory by its max model length (about 39 KiB per token here), hence V4's shorter prompts.
MODELS = {
    "deepseek-v3": {"result": "vllm_serving", "kv_memory": "48MiB", "input_len": 500, "env": {},
                    "args": ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]},
    "deepseek-v4": {"result": "vllm_serving_deepseek_v4", "kv_memory": "16MiB", "input_len": 100,
                    "env": {DEEPSEEK_V4_ENV: "1"}, "args": ["--load-format", "dummy", "--max-model-len", "384"]},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _gauge(text: str, name: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values)


def _cache_config(text: str) -> dict[str, str]:
    labels = re.search(r"^vllm:cache_config_info{([^}]*)}", text, re.M).group(1)
    return dict(re.findall(r'(\w+)="([^"]*)"', labels))


def _capacity_tokens(text: str) -> int:
    fields = _cache_config(text)
    return int(fields["num_gpu_blocks"]) * int(fields["block_size"])


class Server:
    """vLLM's OpenAI server at TP 2, started and stopped around a `with`."""

    def __init__(self, model: str, kvpp: bool, kv_memory: int, log: Path, kind: dict) -> None:
        self.port = _free_port()
        self.log = log
        self.command = [
            sys.executable, "-m", "tests.integrations.vllm.serve", "--model", model, "--served-model-name",
            "tiny", "--host", "127.0.0.1", "--port", str(self.port), "--tensor-parallel-size", "2",
            "--kv-cache-memory-bytes", str(kv_memory), "--dtype", "bfloat16", "--enforce-eager", *kind["args"],
            "--additional-config", json.dumps({"enable_kvpp": kvpp})]
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                        VLLM_LOGGING_LEVEL="WARNING", VLLM_SERVER_DEV_MODE="1", **kind["env"])

    def __enter__(self) -> Server:
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return self
            except OSError:
                time.sleep(2)

    def __exit__(self, *exc) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def reset_prefix_cache(self) -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60):
            pass

    def kvpp_stats(self) -> list:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/collective_rpc",
                                         data=json.dumps({"method": "kvpp_stats"}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["results"]


def client(server: Server, model: str, args: argparse.Namespace, requests: int, concurrency: int) -> dict:
    """vLLM's benchmark client (``vllm bench serve``) against `server`: random prompts of a fixed seed."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return main(parser.parse_args([
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}", "--model", "tiny",
        "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--num-prompts",
        str(requests), "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
        "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl", "--save-detailed"]))


def drive(server: Server, model: str, args: argparse.Namespace) -> dict:
    """The load (every request at once, /metrics sampled meanwhile), then the greedy check: a few
    requests at a concurrency both servers hold, so both schedule the same batches (vLLM's numerics
    depend on the batch, so under load, where KVPP runs more requests at once, tokens may differ)."""
    running, stop = [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            running.append(_gauge(_metrics(server.port), "vllm:num_requests_running"))
            time.sleep(0.2)

    before = _metrics(server.port)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = client(server, model, args, args.requests, args.requests)
    finally:
        stop.set()
        sampler.join()
    after = _metrics(server.port)
    # the check's prompts are the load's first four: from an empty prefix cache, both servers compute them alike
    server.reset_prefix_cache()
    check = client(server, model, args, 4, 2)
    return {
        "kv_capacity_tokens": _capacity_tokens(after),
        "kv_blocks": int(_cache_config(after)["num_gpu_blocks"]),
        "max_running": int(max(running)),
        "preemptions": int(_gauge(after, "vllm:num_preemptions_total") - _gauge(before, "vllm:num_preemptions_total")),
        "completed": result["completed"],
        "output_throughput_tok_s": result["output_throughput"],
        "median_ttft_ms": result["median_ttft_ms"],
        "median_tpot_ms": result["median_tpot_ms"],
        "generated_texts": check["generated_texts"],
        "generated_texts_under_load": result["generated_texts"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(MODELS), default="deepseek-v3")
    parser.add_argument("--layers", type=int, default=None, help="DeepSeek-V3's layers (default 16)")
    parser.add_argument("--kv-memory", default=None, help="per rank (default: the model's in MODELS)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=None, help="default: the model's in MODELS")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    kind = MODELS[args.model]
    if args.model == "deepseek-v4" and args.layers is not None:
        parser.error("--layers: the DeepSeek-V4 model is the tests' tiny one, of 4 layers")
    args.layers = TINY_DEEPSEEK_V4_LAYERS if args.model == "deepseek-v4" else args.layers or 16
    args.input_len = args.input_len or kind["input_len"]
    kv_memory = parse_bytes(args.kv_memory or kind["kv_memory"])
    with tempfile.TemporaryDirectory(prefix="kvpp-serving-") as tmp:
        if args.model == "deepseek-v4":
            model = make_tiny_deepseek_v4_config(Path(tmp) / "model", tokenizer=True)
        else:
            model = make_tiny_deepseek(Path(tmp) / "model", num_layers=args.layers)
        runs = {}
        for name, kvpp in (("off", False), ("on", True)):
            with Server(model, kvpp, kv_memory, Path(tmp) / f"{name}.log", kind) as server:
                runs[name] = drive(server, model, args)
                if kvpp:
                    stats = server.kvpp_stats()
                    runs[name]["attention_backends"] = stats[0]["attention_backends"]
                    runs[name]["kvpp_bytes_per_rank"] = [s["bytes"] for s in stats]
            print(f"{name}: " + json.dumps({k: v for k, v in runs[name].items() if k != "generated_texts"}))
    off, on = runs["off"], runs["on"]
    equal = off.pop("generated_texts") == on.pop("generated_texts")
    under_load = [a == b for a, b in zip(off.pop("generated_texts_under_load"), on.pop("generated_texts_under_load"))]
    result = {
        "model": args.model, "layers": args.layers, "tp": 2, "kv_memory_bytes": kv_memory, "requests": args.requests,
        "input_len": args.input_len, "output_len": args.output_len, "dtype": "bfloat16",
        "attention_backend": on["attention_backends"], "off": off, "on": on,
        "capacity_ratio": on["kv_blocks"] / off["kv_blocks"],
        "max_running_ratio": on["max_running"] / off["max_running"],
        "throughput_ratio": on["output_throughput_tok_s"] / off["output_throughput_tok_s"],
        "greedy_outputs_equal": equal,
        "greedy_check": "4 requests, 2 at a time (the same batches with KVPP off and on)",
        "equal_outputs_under_load": sum(under_load),
    }
    print(f"capacity {result['capacity_ratio']:.2f}x, requests running at once {off['max_running']} -> "
          f"{on['max_running']}, preemptions {off['preemptions']} -> {on['preemptions']}, output throughput "
          f"{result['throughput_ratio']:.2f}x, greedy outputs equal: {equal} (under load {sum(under_load)} of "
          f"{len(under_load)})")
    write_result(kind["result"], result, args.out)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
