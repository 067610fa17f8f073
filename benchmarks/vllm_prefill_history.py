"""Prefill history in vLLM with KVPP: what a later chunk of a long prompt and a prefix-cache hit move, and
what their steps cost, KVPP off and on.

    python benchmarks/vllm_prefill_history.py [--prompt 1536] [--budget 256] [--prefix 1024]

A tiny random DeepSeek-V3 (6 layers, 4 heads, kv_lora_rank 512, rope 64, float32) on CPU_MLA at TP 2,
eagerly, with chunked prefill and prefix caching on (restored on vLLM CPU by the tests' shim,
`tests/integrations/vllm/cpu_chunked_prefill.py`, as vLLM runs them on CUDA by default), so KVPP takes compact
slots and each prefill row's history streams from the layer's owner into vLLM's context workspace
(`kvpp_fx/integrations/vllm/attention/context_stream.py`). Two workloads on one engine, each run on a fresh KVPP
runtime (its counters its own):

- ``chunked``: one prompt of ``--prompt`` tokens under a ``--budget`` token budget: its later chunks read
  the earlier ones as history;
- ``prefix_hit``: a prompt of ``--prefix`` tokens, then (measured) the same prefix plus 128 new tokens,
  which hits the first's full blocks.

Reported per workload: the steps' total and per-step time against KVPP off, the bytes each rank moved,
and the formula they must equal: per layer, each history chunk's tokens x 576 x 4 bytes (the owner's
link sends it, a receiver's brings it in), so per rank ``6 x sum(history tokens) x 2304``. Beside it:
what the same steps would move with whole-layer slots (each layer's whole pool, per step with history).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import summary, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tests.integrations.vllm.triton_interpreter  # noqa: E402, F401  (vLLM's default runner, V2, on CPU; before vLLM)
from tests.integrations.vllm import cpu_chunked_prefill  # noqa: E402  (chunked prefill on CPU_MLA, in every process)
from tests.integrations.vllm.tiny_model import NUM_LAYERS, make_tiny_deepseek  # noqa: E402

BLOCK_SIZE, RECORD = 16, 576 * 4
MEMORY = 256 << 20


def prompt(length: int, seed: int = 3) -> list[int]:
    return [(7 * i + seed) % 500 for i in range(length)]


def workloads(args) -> dict[str, tuple[list[list[int]], list[int]]]:
    """name: (prompts run first, unmeasured; the measured prompt)."""
    prefix = prompt(args.prefix, 5)
    return {"chunked": ([], prompt(args.prompt)),
            "prefix_hit": ([prefix], prefix + prompt(128, 11))}


def history_tokens(length: int, computed: int, budget: int) -> int:
    """The history the measured prompt's prefill steps read: each chunk reads every token before it."""
    total = 0
    while computed < length:
        total += computed
        computed += min(budget, length - computed)
    return total


def engine_main(model: str, kvpp: bool, args) -> dict:
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    cpu_chunked_prefill.apply()
    from vllm import LLM, SamplingParams

    from kvpp_fx.integrations.vllm.engine.stats import worker_stats

    llm = LLM(model=model, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              attention_backend="CPU_MLA", enforce_eager=True, max_model_len=max(args.prompt, args.prefix + 128) + 16,
              block_size=BLOCK_SIZE, enable_chunked_prefill=True, enable_prefix_caching=True,
              max_num_batched_tokens=args.budget, kv_cache_memory_bytes=MEMORY, disable_log_stats=False,
              compilation_config={"custom_ops": ["-rotary_embedding"]}, additional_config={"enable_kvpp": kvpp})
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine = llm.llm_engine
    # First steps pay one-time costs (allocations, first kernels): a chunked prompt first, unmeasured.
    llm.generate([{"prompt_token_ids": prompt(args.budget * 3, 17)}], params, use_tqdm=False)
    out = {}
    for name, (warm, measured) in workloads(args).items():
        llm.reset_prefix_cache()
        for k, p in enumerate(warm):
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        if kvpp:
            llm.collective_rpc("kvpp_set_device_api", args=(None,))  # a fresh runtime: its own counters
        hits = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
        engine.add_request(name, {"prompt_token_ids": measured}, params)
        steps = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        run = {"steps_s": steps, "total_s": sum(steps), "length": len(measured),
               "prefix_hit_tokens": sum(int(m.value) for m in llm.get_metrics()
                                        if m.name == "vllm:prefix_cache_hits") - hits}
        if kvpp:
            stats = llm.collective_rpc(worker_stats)
            run["ranks"] = [{"bytes": s["bytes"], "context_bytes": s["context_bytes"],
                             "context_chunks": s["context_chunks"], "context_ahead": s["context_ahead"],
                             "broadcasts": s["broadcasts"],
                             "num_blocks": s["num_blocks"], "scratch_blocks": s["scratch_blocks"]} for s in stats]
        out[name] = run
    return out


def run_engine(model: str, kvpp: bool, argv: list[str]) -> dict:
    command = [sys.executable, __file__, "--engine", "on" if kvpp else "off", "--model", model, *argv]
    out = subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", HF_HUB_OFFLINE="1",
                                  **{cpu_chunked_prefill.ENV: "1"}))
    line = next((l for l in out.stdout.splitlines() if l.startswith("ENGINE ")), None)
    if line is None:
        raise SystemExit(f"the {'KVPP' if kvpp else 'KVPP-off'} engine failed:\n{out.stderr[-4000:]}")
    return json.loads(line.removeprefix("ENGINE "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=1536)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--engine", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.engine:
        print("ENGINE " + json.dumps(engine_main(args.model, args.engine == "on", args)))
        return
    argv = ["--prompt", str(args.prompt), "--budget", str(args.budget), "--prefix", str(args.prefix)]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_deepseek(Path(tmp) / "tiny", max_positions=max(args.prompt, args.prefix + 128) + 64)
        on = run_engine(model, True, argv)
        off = run_engine(model, False, argv)
    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec

    spec = ModelCacheSpec("tiny", BLOCK_SIZE, tuple(LayerCacheSpec(i, (ComponentSpec("kv", "float32", (576,)),))
                                                    for i in range(NUM_LAYERS)))
    whole_pool = KVPPPlan(spec, group_size=2).num_blocks(MEMORY)
    rows = {}
    for name, run in on.items():
        computed = run["prefix_hit_tokens"]
        history = history_tokens(run["length"], computed, args.budget)
        steps_with_history = sum(1 for s in range(len(run["steps_s"])) if s > 0 or computed > 0)
        rows[name] = {
            "prompt_tokens": run["length"], "prefix_hit_tokens": computed, "history_tokens_read": history,
            "steps": len(run["steps_s"]),
            "bytes_per_rank": [r["bytes"] for r in run["ranks"]],
            "context_chunks_per_rank": [r["context_chunks"] for r in run["ranks"]],
            "context_ahead_per_rank": [r["context_ahead"] for r in run["ranks"]],
            "formula_bytes_per_rank": NUM_LAYERS * history * RECORD,
            "whole_layer_slots_bytes_per_rank": NUM_LAYERS * steps_with_history * whole_pool * BLOCK_SIZE * RECORD,
            "num_blocks": run["ranks"][0]["num_blocks"], "scratch_blocks": run["ranks"][0]["scratch_blocks"],
            "on_total_s": run["total_s"], "off_total_s": off[name]["total_s"],
            "on_over_off": run["total_s"] / off[name]["total_s"],
            "on_step_s": summary(run["steps_s"]), "off_step_s": summary(off[name]["steps_s"]),
        }
    result = {"model": "tiny DeepSeek-V3, 6 layers, 4 heads, float32, CPU_MLA, TP 2, eager",
              "token_budget": args.budget, "kv_memory_bytes": MEMORY, "whole_layer_slots_pool_blocks": whole_pool,
              "workloads": rows,
              "bytes_match_formula": all(all(b == r["formula_bytes_per_rank"] for b in r["bytes_per_rank"])
                                         for r in rows.values())}
    write_result("vllm_prefill_history", result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
