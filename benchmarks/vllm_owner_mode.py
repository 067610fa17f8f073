"""Owner mode in vLLM: a decode step's bytes do not grow with the context, and what a decode step costs.

    python benchmarks/vllm_owner_mode.py [--contexts 1024,4096,16384] [--decode-steps 8]
    python benchmarks/vllm_owner_mode.py --model deepseek-v3.2 [--contexts 1024,4096,8192]

A tiny random DeepSeek-V3 (6 layers, 4 heads, kv_lora_rank 512, rope 64, float32 on CPU_MLA, no MTP) runs
at TP 2, eagerly, through ``LLM``, on vLLM's default model runner, V2 (its Triton kernels under Triton's
interpreter, in the KVPP-off engine too). For each prompt length, one request prefills and then decodes alone,
step by step (``llm_engine.step``); the same engine runs it in broadcast mode and in owner mode
(``collective_rpc("kvpp_set_mode")``; each run on a fresh runtime, so its counters are its own).
Reported per mode and context:

- the bytes of the last decode step on each rank (``last_forward``), against the formula:
  broadcast: per layer, the request's history blocks, ``ceil(computed / 16) x (16 x 576 x 4 + 8)`` bytes
  (sent by the owner, received by the other rank), or, with whole-layer slots, the whole layer,
  ``num_blocks x 16 x 576 x 4``, once the blocks pass the crossover (``KVPPPlan.uses_active_blocks``;
  this engine takes compact slots, which always pack: `integrations/vllm/cache/scratch.py`); owner:
  per layer, ``T x 2 heads x (576 + 512) x 4`` bytes for T = 1 decode token, whatever the context;
- the ratio of the longest context's bytes to the shortest's, per mode (the issue asks <= 1.3 for owner);
- the median decode step time, against an engine with KVPP off, at the longest context.

``--model deepseek-v3.2``: the tests' tiny DeepSeek-V3.2 (2 layers, 4 heads, index top-k 512, float32, vLLM's
dummy weights widened) through vLLM's own V3.2 classes with the tests' torch stand-ins for the sparse kernels
vLLM CPU lacks (`tests/integrations/vllm/deepseek_v32_on_cpu.py`, in every engine process). The KVPP engine
starts in broadcast mode, so its slots are whole layers and both modes run on it (one that starts in "auto" takes
owner-only slots, on which every mode sends rows to the owners). Its steps send every row to the owners (owner
mode) or whole layers (broadcast mode), so the broadcast side is the whole layer of each non-owned layer, latent
rows and indexer keys; result ``vllm_owner_mode_deepseek_v32``.
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

import tests.integrations.vllm.triton_interpreter  # noqa: E402, F401  (vLLM's default runner, V2, on CPU; before vLLM)
from tests.integrations.vllm import deepseek_v32_on_cpu  # noqa: E402  (DeepSeek-V3.2's stand-ins, where its env asks)
from tests.integrations.vllm.tiny_model import (NUM_LAYERS, TINY_DEEPSEEK_V32, make_tiny_deepseek,  # noqa: E402
                                                make_tiny_deepseek_v32_config)

BLOCK_SIZE, RECORD = 16, 576 * 4
BLOCK_BYTES = BLOCK_SIZE * RECORD + 8  # one block of one layer in an active-block broadcast, with its id
OWNER_BYTES_PER_TOKEN = 2 * (576 + 512) * 4  # per layer: 2 heads' queries out, their latent back


def prompt(length: int) -> list[int]:
    return [(7 * i + 3) % 500 for i in range(length)]


def engine_main(model: str, kvpp: bool, contexts: list[int], decode_steps: int, sparse: bool = False) -> dict:
    """In its own interpreter: one engine, each context in each mode (KVPP off: once)."""
    import time

    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    from vllm import LLM, SamplingParams

    from kvpp_fx.integrations.vllm.engine.stats import worker_stats

    llm = LLM(model=model, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
              attention_backend="CPU_MLA", enforce_eager=True, max_model_len=max(contexts) + decode_steps + 16,
              kv_cache_memory_bytes=512 << 20, compilation_config={"custom_ops": ["-rotary_embedding"]},
              additional_config={"enable_kvpp": kvpp, **({"kvpp_mode": "broadcast"} if kvpp and sparse else {})},
              **({"load_format": "dummy"} if sparse else {}))
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True)
    engine = llm.llm_engine
    runs = []
    for mode in (("broadcast", "owner") if kvpp else ("off",)):
        for context in contexts:
            if kvpp:
                llm.collective_rpc("kvpp_set_mode", args=(mode,))
                llm.collective_rpc("kvpp_set_device_api", args=(None,))  # a fresh runtime: its own counters
            engine.add_request(f"{mode}-{context}", {"prompt_token_ids": prompt(context)}, params)
            engine.step()  # the prefill (and the first token)
            steps = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            run = {"mode": mode, "context": context, "decode_step_s": summary(steps)}
            if kvpp:
                stats = llm.collective_rpc(worker_stats)
                run["num_blocks"] = stats[0]["num_blocks"]
                run["scratch_blocks"] = stats[0]["scratch_blocks"]
                run["last_step"] = [{"rank": s["rank"], "bytes": s["last_forward"]["bytes"],
                                     "mode": s["last_forward"]["mode"], "exchanges": s["last_forward"]["exchanges"],
                                     "broadcasts": s["last_forward"]["broadcasts"]} for s in stats]
            runs.append(run)
    return {"runs": runs}


def run_engine(model: str, kvpp: bool, contexts: list[int], decode_steps: int, sparse: bool = False) -> dict:
    command = [sys.executable, __file__, "--engine", "on" if kvpp else "off", "--model-dir", model,
               "--contexts", ",".join(map(str, contexts)), "--decode-steps", str(decode_steps)]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", HF_HUB_OFFLINE="1")
    if sparse:
        env[deepseek_v32_on_cpu.ENV] = "1"
    out = subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=1800, env=env)
    line = next((l for l in out.stdout.splitlines() if l.startswith("ENGINE ")), None)
    if line is None:
        raise SystemExit(f"the {'KVPP' if kvpp else 'KVPP-off'} engine failed:\n{out.stderr[-4000:]}")
    return json.loads(line.removeprefix("ENGINE "))


def formula(mode: str, computed: int, num_blocks: int, scratch_blocks: int | None = None,
            sparse: bool = False) -> int | None:
    """Bytes one rank moves in a decode step over `computed` tokens at TP 2 (each rank sends its 3 layers'
    blocks and receives the other 3's), on the slots the engine took (`scratch_blocks`: compact slots of
    that many blocks, which always pack; None: whole-layer slots)."""
    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec

    if mode == "owner":
        return (TINY_DEEPSEEK_V32["num_hidden_layers"] if sparse else NUM_LAYERS) * OWNER_BYTES_PER_TOKEN
    if sparse:  # whole layers, latent rows and indexer keys: measured, not modelled here
        return None
    blocks = -(-computed // BLOCK_SIZE)
    spec = ModelCacheSpec("tiny", BLOCK_SIZE, tuple(LayerCacheSpec(i, (ComponentSpec("kv", "float32", (576,)),))
                                                    for i in range(NUM_LAYERS)))
    if KVPPPlan(spec, group_size=2, scratch_blocks=scratch_blocks).uses_active_blocks(blocks, num_blocks):
        return NUM_LAYERS * blocks * BLOCK_BYTES
    return NUM_LAYERS * num_blocks * BLOCK_SIZE * RECORD  # whole layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--model", choices=("deepseek-v3", "deepseek-v3.2"), default="deepseek-v3")
    parser.add_argument("--engine", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    sparse = args.model == "deepseek-v3.2"
    if args.engine:
        print("ENGINE " + json.dumps(engine_main(args.model_dir, args.engine == "on", contexts, args.decode_steps,
                                                 sparse=bool(os.environ.get(deepseek_v32_on_cpu.ENV)))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if sparse:
            model = make_tiny_deepseek_v32_config(Path(tmp) / "tiny_v32", max_positions=max(contexts) + 1024)
        else:
            model = make_tiny_deepseek(Path(tmp) / "tiny", max_positions=max(contexts) + 1024)
        on = run_engine(model, True, contexts, args.decode_steps, sparse)
        off = run_engine(model, False, contexts, args.decode_steps, sparse)
    rows = []
    for run in on["runs"]:
        last = run["last_step"]
        rows.append({"mode": run["mode"], "context": run["context"], "bytes_per_rank": [r["bytes"] for r in last],
                     "last_step_mode": [r["mode"] for r in last], "decode_step_s": run["decode_step_s"]["median"],
                     "num_blocks": run["num_blocks"],
                     "scratch_blocks": run["scratch_blocks"],
                     "broadcast_formula_upper": formula("broadcast", run["context"] + args.decode_steps,
                                                        run["num_blocks"], run["scratch_blocks"], sparse),
                     "broadcast_formula_lower": formula("broadcast", run["context"], run["num_blocks"],
                                                        run["scratch_blocks"], sparse),
                     "owner_formula": formula("owner", run["context"], run["num_blocks"], sparse=sparse)})
    by = {(r["mode"], r["context"]): r for r in rows}
    shortest, longest = min(contexts), max(contexts)
    ratios = {mode: max(by[(mode, longest)]["bytes_per_rank"]) / max(by[(mode, shortest)]["bytes_per_rank"])
              for mode in ("broadcast", "owner")}
    off_step = {run["context"]: run["decode_step_s"]["median"] for run in off["runs"]}
    step_ratio = {mode: by[(mode, longest)]["decode_step_s"] / off_step[longest] for mode in ("broadcast", "owner")}
    owner_exact = all(all(b == r["owner_formula"] for b in r["bytes_per_rank"]) for r in rows if r["mode"] == "owner")
    broadcast_bounded = None if sparse else all(r["broadcast_formula_lower"] <= b <= r["broadcast_formula_upper"]
                                                for r in rows if r["mode"] == "broadcast" for b in r["bytes_per_rank"])
    model_name = ("tiny DeepSeek-V3.2, 2 layers, 4 heads, index top-k 512, float32, torch sparse stand-ins" if sparse
                  else "tiny DeepSeek-V3, 6 layers, 4 heads, float32, CPU_MLA")
    result = {"model": model_name, "tp": 2, "contexts": contexts,
              "decode_steps": args.decode_steps, "rows": rows, "off_decode_step_s": off_step,
              f"bytes_ratio_{longest}_over_{shortest}": ratios, "owner_bytes_match_formula": owner_exact,
              "broadcast_bytes_within_formula": broadcast_bounded,
              f"decode_step_over_off_at_{longest}": step_ratio}
    write_result("vllm_owner_mode_deepseek_v32" if sparse else "vllm_owner_mode", result, args.out)
    print(json.dumps({k: result[k] for k in result if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
