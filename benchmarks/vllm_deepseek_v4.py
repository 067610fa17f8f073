"""KVPP on DeepSeek-V4 in vLLM: a decode step's bytes do not grow with the context; vLLM's blocks at equal memory.

    python benchmarks/vllm_deepseek_v4.py [--contexts 1024,8192] [--decode-steps 4]

The tests' tiny random DeepSeek-V4 (`tests/integrations/vllm/tiny_model.py`: a window-only layer, two ratio-4
layers with the indexer, a ratio-128 layer; 8 heads of 512, bfloat16) runs at TP 2 on vLLM CPU, with vLLM's
defaults, through ``LLM``, with the tests' shims (`deepseek_v4_on_cpu`: vLLM 0.32's window-metadata bug, widened
dummy weights; Triton's interpreter for V4's metadata builders). For each prompt length, one request prefills,
then decodes alone, step by step. Reported:

- each rank's bytes in the last decode step (``last_forward``), against the formula: per target layer, its
  queries out and its outputs back, ``2 x T x 4 heads x 512 x 2`` bytes for T = 1, whatever the context;
  the ratio of the longest context's bytes to the shortest's;
- what a broadcast of the step's cache reads would move instead (`LayerCachesPlan.decode_read_bytes`, the
  tiny model's layers at that context), for scale;
- vLLM's block count with KVPP on and off at equal KV memory (512 MiB per rank);
- the median decode step time, KVPP on against off, at the longest context.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import summary, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tests.integrations.vllm.triton_interpreter  # noqa: E402, F401  (V4's Triton metadata builders; before vLLM)
from tests.integrations.vllm.deepseek_v4_on_cpu import ENV  # noqa: E402
from tests.integrations.vllm.tiny_model import TINY_DEEPSEEK_V4, make_tiny_deepseek_v4_config  # noqa: E402

HEADS_PER_RANK, HEAD_DIM = TINY_DEEPSEEK_V4["num_attention_heads"] // 2, TINY_DEEPSEEK_V4["head_dim"]
LAYERS = TINY_DEEPSEEK_V4["num_hidden_layers"]
KV_MEMORY = 512 << 20


def prompt(length: int) -> list[int]:
    return [(7 * i + 3) % 500 for i in range(length)]


def engine_main(model: str, kvpp: bool, contexts: list[int], decode_steps: int) -> dict:
    """In its own interpreter: one engine, each context in turn."""
    import time

    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      **{ENV: "1"})
    from tests.integrations.vllm import deepseek_v4_on_cpu

    deepseek_v4_on_cpu.apply()
    from vllm import LLM, SamplingParams

    from kvpp_fx.integrations.vllm.engine.stats import worker_stats

    llm = LLM(model=model, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="bfloat16", load_format="dummy",
              max_model_len=max(contexts) + decode_steps + 16, kv_cache_memory_bytes=KV_MEMORY,
              additional_config={"enable_kvpp": kvpp})
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True)
    engine = llm.llm_engine
    runs = []
    for context in contexts:
        engine.add_request(f"r{context}", {"prompt_token_ids": prompt(context)}, params)
        engine.step()  # the prefill (and the first token)
        steps = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        run = {"context": context, "decode_step_s": summary(steps)}
        if kvpp:
            stats = llm.collective_rpc(worker_stats)
            run["last_step"] = [{"rank": s["rank"], "bytes": s["last_forward"]["bytes"],
                                 "exchanges": s["last_forward"]["exchanges"]} for s in stats]
        runs.append(run)
    blocks = llm.collective_rpc(num_blocks)
    return {"runs": runs, "num_blocks": blocks[0]}


def num_blocks(worker) -> int:
    return int(worker.model_runner.kv_cache_config.num_blocks)


def run_engine(model: str, kvpp: bool, contexts: list[int], decode_steps: int) -> dict:
    command = [sys.executable, __file__, "--engine", "on" if kvpp else "off", "--model", model,
               "--contexts", ",".join(map(str, contexts)), "--decode-steps", str(decode_steps)]
    out = subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=3600,
                         env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", HF_HUB_OFFLINE="1"))
    line = next((l for l in out.stdout.splitlines() if l.startswith("ENGINE ")), None)
    if line is None:
        raise SystemExit(f"the {'KVPP' if kvpp else 'KVPP-off'} engine failed:\n{out.stderr[-4000:]}")
    return json.loads(line.removeprefix("ENGINE "))


def broadcast_bytes(context: int) -> int:
    """What one decode token reads from the tiny model's caches at `context` tokens (a broadcast's bytes)."""
    from kvpp_fx.cache.layer_caches import LayerCachesPlan, deepseek_v4_caches

    return LayerCachesPlan(deepseek_v4_caches(TINY_DEEPSEEK_V4), 2).decode_read_bytes(context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--engine", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.engine:
        print("ENGINE " + json.dumps(engine_main(args.model, args.engine == "on", contexts, args.decode_steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_deepseek_v4_config(Path(tmp) / "tiny_v4", max_positions=max(contexts) + 1024)
        on = run_engine(model, True, contexts, args.decode_steps)
        off = run_engine(model, False, contexts, args.decode_steps)
    owner_formula = LAYERS * 2 * HEADS_PER_RANK * HEAD_DIM * 2
    rows = [{"context": run["context"], "bytes_per_rank": [r["bytes"] for r in run["last_step"]],
             "owner_formula": owner_formula, "broadcast_bytes": broadcast_bytes(run["context"]),
             "decode_step_s": run["decode_step_s"]["median"]} for run in on["runs"]]
    by = {r["context"]: r for r in rows}
    shortest, longest = min(contexts), max(contexts)
    off_step = {run["context"]: run["decode_step_s"]["median"] for run in off["runs"]}
    result = {"model": "tiny DeepSeek-V4, 4 layers (ratios 0, 4, 128, 4), 8 heads, bfloat16, vLLM CPU", "tp": 2,
              "contexts": contexts, "decode_steps": args.decode_steps, "rows": rows,
              "bytes_ratio": max(by[longest]["bytes_per_rank"]) / max(by[shortest]["bytes_per_rank"]),
              "bytes_match_formula": all(b == owner_formula for r in rows for b in r["bytes_per_rank"]),
              "kv_memory_bytes": KV_MEMORY, "num_blocks": {"off": off["num_blocks"], "on": on["num_blocks"]},
              "capacity_ratio": on["num_blocks"] / off["num_blocks"],
              "decode_step_over_off": by[longest]["decode_step_s"] / off_step[longest], "off_decode_step_s": off_step}
    write_result("vllm_deepseek_v4", result, args.out)
    print(json.dumps({k: result[k] for k in result if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
