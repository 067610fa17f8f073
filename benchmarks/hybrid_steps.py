"""Hybrid steps in the reference engine: a mixed trace, per-request paths against one path per step.

    python benchmarks/hybrid_steps.py [--preset small] [--long 3072] [--short 512] [--budget 256]

TP 2 on gloo, eager graphs, ``kvpp_mode="auto"`` on the default CPU link model. The trace: a long prompt,
then a short unrelated one whose prefill chunks run next to the long one's decodes (mixed steps), then
both decode. The same trace runs twice: with ``per_request_paths`` (the long decode goes to its owners,
each chunk broadcasts its own history, in one forward) and with one path per step (the whole step
broadcasts, the decode's history included, or goes to the owners, the chunk's queries included).
Reported per run: the bytes over rank 0's link for the mixed steps and in all, the median time of the
mixed steps, each step's mode, and whether both runs' tokens are those of KVPP off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from _common import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpp_fx.launch import run_ranks  # noqa: E402
from kvpp_fx.reference.config import PRESETS  # noqa: E402
from kvpp_fx.reference.engine import EngineConfig  # noqa: E402
from kvpp_fx.reference.generate import rank_groups, run_engine  # noqa: E402


def trace(vocab: int, long: int, short: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (long,), generator=gen).tolist(),
            torch.randint(0, vocab, (short,), generator=gen).tolist()]


def ranks(rank: int, world: int, preset: str, long: int, short: int, budget: int, new_tokens: int) -> dict:
    config = PRESETS[preset]
    prompts = trace(config.vocab_size, long, short)
    groups = rank_groups(rank, world)
    num_blocks = 2 * -(-(long + short + 2 * new_tokens) // 16) + 16
    out = {}
    for name, kvpp, options in (("off", False, {}), ("per_request", True, {"per_request_paths": True}),
                                ("per_step", True, {"per_request_paths": False})):
        torch._dynamo.reset()
        engine_config = EngineConfig(token_budget=budget, max_model_len=long + short + 2 * new_tokens,
                                     kvpp_mode="auto" if kvpp else "broadcast", **options)
        run = run_engine(config, prompts, new_tokens, engine_config=engine_config, groups=groups, kvpp=kvpp,
                         num_blocks=num_blocks)
        out[name] = {"outputs": run["outputs"], "steps": [
            {k: s[k] for k in ("mode", "paths", "seconds", "broadcast_bytes", "owner_bytes", "decode_only",
                               "requests")} for s in run["steps"]]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--long", type=int, default=3072)
    parser.add_argument("--short", type=int, default=512)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--out")
    args = parser.parse_args()
    results = run_ranks(ranks, 2, args.preset, args.long, args.short, args.budget, args.new_tokens, timeout_s=1800)
    rank0 = results[0]
    off = rank0["off"]["outputs"]
    summary = {}
    for name in ("per_request", "per_step"):
        steps = rank0[name]["steps"]
        # mixed: a decode row next to a prefill chunk (more than one request, not decode-only)
        mixed = [s for s in steps if len(s["requests"]) > 1 and not s["decode_only"]]
        summary[name] = {
            "tokens_equal_kvpp_off": all(r[name]["outputs"] == r["off"]["outputs"] for r in results),
            "mixed_steps": len(mixed),
            "mixed_step_modes": sorted({s["mode"] for s in mixed}),
            "mixed_bytes": sum(s["broadcast_bytes"] + s["owner_bytes"] for s in mixed),
            "total_bytes": sum(s["broadcast_bytes"] + s["owner_bytes"] for s in steps),
            "mixed_step_s_median": statistics.median(s["seconds"] for s in mixed) if mixed else None,
            "modes": [s["mode"] for s in steps],
        }
    per_request, per_step = summary["per_request"], summary["per_step"]
    result = {"preset": args.preset, "tp": 2, "long": args.long, "short": args.short, "token_budget": args.budget,
              "new_tokens": args.new_tokens, "kvpp_off_outputs": off, **summary,
              "mixed_bytes_ratio": per_request["mixed_bytes"] / per_step["mixed_bytes"],
              "mixed_step_time_ratio": per_request["mixed_step_s_median"] / per_step["mixed_step_s_median"]}
    write_result("hybrid_steps", result, args.out)
    print({k: v for k, v in result.items() if k not in ("kvpp_off_outputs",)})


if __name__ == "__main__":
    main()
