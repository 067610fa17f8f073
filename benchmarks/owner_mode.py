"""Owner mode against broadcast mode: bytes per decode step at 1k / 8k / 32k context, and decode step time
with KVPP (owner, broadcast and auto mode) over KVPP off at 8k context. `small` preset, TP 2, gloo ranks,
PIECEWISE graph with the eager inner backend.

One run per rank builds two engines with the same pool, budget and graph mode: KVPP off (replicated)
and KVPP on. Both serve the same requests in the same order, so their schedules are identical:

1. Timed workload: two prompts of 8k tokens, prefilled in chunks of the 512-token budget (KVPP in
   "auto"), then decode-only steps whose mode rotates owner, broadcast, auto, ... (KVPP off runs the same
   steps). Rotating per step gives each mode the same contexts and the same share of host noise. The
   first rounds are a warm-up (recompiles for the decode shape); the median decode step per mode over
   the replicated median is the figure. The mode auto chose is recorded per step, prefill included.
2. Bytes at 1k (prefilled), 8k (prefilled, the timed workload's decode steps) and 32k context: decode
   steps alternating broadcast and owner, bytes read from the step records of every rank.
   A 32k prefill would cost minutes of attention on 2 cores (about 1e13 flop), so the 32k request,
   and an 8k one as a cross-check against the prefilled 8k, get a *synthetic context*: blocks
   allocated and marked computed without a prefill, their latent what the pool holds. Bytes per step
   depend only on the blocks read and the query tokens, not on the latent's values.
3. The greedy tokens of every request (all of them KVPP-on with modes mixed per step) must equal the
   KVPP-off tokens, or the script fails before it reports anything.

How the runtime counts bytes (per rank, per decode step; L target layers, N ranks, H heads, T query
tokens, fp32 activations and cache):
- broadcast mode with active blocks: each layer's owner packs the blocks the step reads (every
  component) and their int64 ids into the front of its own scratch slot, and one broadcast per
  component carries them (one here: the latent cache); the owner counts the
  payload it sends, each receiver the payload it receives. A rank owns some layers and receives the
  others, so it counts ``L * blocks * (block_size * (kv_lora_rank + rope) * 4 + 8)``.
- owner mode: for each layer, every rank sends its heads' queries to the owner in one gather
  (``q_latent`` [T, H/N, kv_lora_rank] and ``q_pe`` [T, H/N, rope]) and gets its heads' output
  [T, H/N, kv_lora_rank] back in one scatter. A non-owner counts ``T * H/N * (q + out) * 4`` with
  q = kv_lora_rank + rope and out = kv_lora_rank, the owner ``N - 1`` times that. At N = 2 both
  count the same: ``L * T * H/N * (q + out) * 4`` per step.
- The ratio is therefore ``T * H/N * (q + out) * 4 / (blocks * (block_size * latent * 4 + 8))``, about
  ``H/N * (q + out) / (context * latent)`` per request: for `small` (H 8, kv_lora_rank 128, rope 16)
  ``4 * 272 / (144 * context)``, about 7.6 / context.

    python benchmarks/owner_mode.py [--rounds 18]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from _common import summary, write_result

from kvpp_fx.launch import run_ranks
from kvpp_fx.reference.config import PRESETS
from kvpp_fx.reference.engine import EngineConfig, build_engine
from kvpp_fx.reference.model import TPInfo
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

PRESET = "small"
TP = 2  # the byte formulas below use N = 2, where an owner and a non-owner count the same bytes
BLOCK_SIZE = 16
TOKEN_BUDGET = 512
TIMED_CONTEXT = 8192
TIMED_REQUESTS = 2
# (source, context): the prefilled 8k point is the timed workload; the synthetic 8k one checks the method
BYTE_CONTEXTS = (("prefilled", 1024), ("synthetic", 8192), ("synthetic", 32768))
PREFILL_LIMIT = 4096  # longer byte contexts are synthetic (the timed context is always prefilled)
BYTE_STEPS_PER_MODE = 3
WARMUP_ROUNDS = 2
TIMED_MODES = ("owner", "broadcast", "auto")
CROSSOVER = 0.25  # the runtime's default crossover fraction of the pool (whole-layer slots)
GOAL = 1.10
ITEMSIZE = 4  # fp32 activations and cache
BLOCK_ID_BYTES = 8


@dataclass(frozen=True)
class Setup:
    rounds: int = 18                   # timed decode steps per mode
    timed_context: int = TIMED_CONTEXT
    byte_contexts: tuple[tuple[str, int], ...] = BYTE_CONTEXTS

    @property
    def max_model_len(self) -> int:
        return max([self.timed_context] + [c for _, c in self.byte_contexts]) + 128

    @property
    def pool_blocks(self) -> int:
        """Every step must read at most CROSSOVER of the pool, so broadcast steps take the active-block path."""
        return 4 * (-(-self.max_model_len // BLOCK_SIZE)) + 64


def expected_owner_bytes(cfg, query_tokens: int) -> int:
    """Per rank and step: a non-owner counts its heads' q + out per layer, the owner N - 1 times that; at
    N = 2 the two are equal, so every layer counts the same on every rank."""
    q_width, out_width = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    per_layer = query_tokens * (cfg.num_attention_heads // TP) * (q_width + out_width) * ITEMSIZE
    return cfg.num_hidden_layers * (TP - 1) * per_layer


def block_bytes(cfg) -> int:
    return BLOCK_SIZE * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * ITEMSIZE


def expected_broadcast_bytes(cfg, blocks: int) -> int:
    """Per rank and step: every layer's active blocks of the latent cache plus their ids, sent or received."""
    return cfg.num_hidden_layers * blocks * (block_bytes(cfg) + BLOCK_ID_BYTES)


def tokens(count: int) -> str:
    return f"{count // 1024}k" if count % 1024 == 0 else str(count)


def prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_engine(rank, world, group, kvpp, setup):
    torch._dynamo.reset()
    config = EngineConfig(block_size=BLOCK_SIZE, graph_mode="piecewise", inner="eager", token_budget=TOKEN_BUDGET,
                          max_model_len=setup.max_model_len, kvpp_mode="auto" if kvpp else "broadcast")
    return build_engine(PRESETS[PRESET], engine_config=config, num_blocks=setup.pool_blocks, kvpp=kvpp,
                        tp=TPInfo(rank, world, dist.group.WORLD), kvpp_group=group)


def step(engine, mode, phase, context):
    if engine.plan.enabled:
        engine.kvpp_mode = mode
    record = engine.step()
    record.update(asked=mode if engine.plan.enabled else "off", phase=phase, context=context)
    return record


def prefill(engine, requests, context):
    records = []
    while any(r.prefilling for r in requests):
        records.append(step(engine, "auto", "prefill", context))
    return records


def decode(engine, requests, modes, phase, context):
    """Run ``len(modes)`` decode-only steps, one per mode; every request finishes on the last one."""
    for r in requests:
        r.max_new_tokens = len(r.output) + len(modes)
    records = [step(engine, mode, phase, context) for mode in modes]
    if not all(r.finished for r in requests) or not all(rec["decode_only"] for rec in records):
        raise RuntimeError(f"the {phase} phase did not run {len(modes)} decode-only steps of all requests.")
    return records


def synthetic_request(engine, context, seed):
    """A request whose first `context` tokens count as computed, without a prefill: its blocks come from
    the pool as a prefill would take them, and the latent they hold is whatever the pool holds."""
    vocab = engine.cfg.vocab_size
    ids = prompt(vocab, context + 1, seed)
    request = engine.add_request(ids[:context], 1)
    request.blocks = [engine.pool.allocate() for _ in range(-(-context // BLOCK_SIZE))]
    request.admitted, request.num_computed, request.output = True, context, ids[context:]
    return request


def workload(engine, setup):
    """The same requests and steps on either engine; returns the step records and the tokens."""
    vocab = engine.cfg.vocab_size
    records, outputs = [], {}
    # 1. timed: two 8k prompts; the decode-only steps rotate the modes
    context = setup.timed_context
    timed = [engine.add_request(prompt(vocab, context, seed=100 + i), setup.max_model_len - context - 1)
             for i in range(TIMED_REQUESTS)]
    records += prefill(engine, timed, context)
    records += decode(engine, timed, TIMED_MODES * WARMUP_ROUNDS, "warmup", context)
    records += decode(engine, timed, TIMED_MODES * setup.rounds, "timed", context)
    outputs["timed"] = [r.output for r in timed]
    # 2. bytes: one request per context, decode steps alternating broadcast and owner
    alternate = ("broadcast", "owner") * BYTE_STEPS_PER_MODE
    for source, context in setup.byte_contexts:
        if source == "prefilled":
            request = engine.add_request(prompt(vocab, context, seed=200 + context), len(alternate) + 1)
            records += prefill(engine, [request], context)
        else:
            request = synthetic_request(engine, context, seed=300 + context)
        records += decode(engine, [request], alternate, f"bytes {source} {context}", context)
        outputs[f"{source} {context}"] = request.output
    return records, outputs


def worker(rank, world, setup):
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    out = {}
    for kvpp in (False, True):
        start = time.perf_counter()
        engine = make_engine(rank, world, group, kvpp, setup)
        records, outputs = workload(engine, setup)
        out["kvpp" if kvpp else "off"] = {"steps": records, "outputs": outputs,
                                          "modes": engine.runtime.stats()["modes"],
                                          "wall_s": time.perf_counter() - start}
        engine.runtime.close()
        del engine
        gc.collect()
    return out


def check_decode_record(cfg, rec):
    """Bytes of one KVPP decode step against the formula; a broadcast step must have read active blocks."""
    mode = rec["mode"]
    if rec["asked"] in ("broadcast", "owner") and mode != rec["asked"]:
        raise RuntimeError(f"asked for {rec['asked']} mode, the step ran {mode}: {rec}")
    if mode == "broadcast":
        if rec["active_blocks"] > CROSSOVER * rec["pool_blocks"]:
            raise RuntimeError(f"{rec['active_blocks']} of {rec['pool_blocks']} blocks read: above the crossover, "
                               "the step sent whole layers; enlarge the pool.")
        if rec["broadcast_bytes"] == cfg.num_hidden_layers * rec["pool_blocks"] * block_bytes(cfg):
            raise RuntimeError(f"a broadcast step sent whole layers: {rec}")
        return rec["broadcast_bytes"], expected_broadcast_bytes(cfg, rec["active_blocks"])
    return rec["owner_bytes"], expected_owner_bytes(cfg, rec["num_tokens"])


def byte_rows(cfg, setup, per_rank):
    """Per context: median bytes per decode step by mode and rank, the ratio, and the formula's figures."""
    rows = []
    phases = [("prefilled", setup.timed_context, "timed")]
    phases += [(source, context, f"bytes {source} {context}") for source, context in setup.byte_contexts]
    phases.sort(key=lambda p: (p[1], p[0]))
    for source, context, phase in phases:
        row = {"context_tokens": context, "context": source, "ranks": []}
        for rank, steps in enumerate(per_rank):
            chosen = [s for s in steps if s["phase"] == phase and s["asked"] in ("broadcast", "owner")]
            by_mode = {}
            for mode in ("broadcast", "owner"):
                mine = [s for s in chosen if s["asked"] == mode]
                measured, expected = zip(*(check_decode_record(cfg, s) for s in mine))
                by_mode[mode] = {"steps": len(mine), "bytes": statistics.median(measured),
                                 "formula_bytes": statistics.median(expected),
                                 "every_step_matches_formula": list(measured) == list(expected),
                                 "blocks_read": statistics.median(s["active_blocks"] for s in mine),
                                 "query_tokens": statistics.median(s["num_tokens"] for s in mine),
                                 "pool_blocks": mine[0]["pool_blocks"]}
            b, o = by_mode["broadcast"], by_mode["owner"]
            row["ranks"].append({"rank": rank, **{f"{m}": v for m, v in by_mode.items()},
                                 "ratio": o["bytes"] / b["bytes"],
                                 "formula_ratio_at_blocks_read": o["formula_bytes"] / b["formula_bytes"]})
        requests = int(row["ranks"][0]["owner"]["query_tokens"])
        row["requests"] = requests
        row["formula_ratio_at_context"] = (expected_owner_bytes(cfg, 1)
                                           / expected_broadcast_bytes(cfg, -(-context // BLOCK_SIZE)))
        heads = cfg.num_attention_heads // TP
        q_out = 2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim
        row["approx_ratio"] = heads * q_out / (context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))
        row["ratio"] = row["ranks"][0]["ratio"]
        row["ranks_agree"] = len({r["ratio"] for r in row["ranks"]}) == 1
        row["every_step_matches_formula"] = all(r[m]["every_step_matches_formula"] for r in row["ranks"]
                                                for m in ("owner", "broadcast"))
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=Setup.rounds, help="timed decode steps per mode")
    parser.add_argument("--timed-context", type=int, default=TIMED_CONTEXT)
    parser.add_argument("--contexts", type=int, nargs="+", default=[c for _, c in BYTE_CONTEXTS],
                        help=f"byte contexts; up to {PREFILL_LIMIT} tokens prefilled, longer ones synthetic")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cfg = PRESETS[PRESET]
    start = time.perf_counter()
    byte_contexts = tuple(("prefilled" if c <= PREFILL_LIMIT else "synthetic", c) for c in args.contexts
                          if c != args.timed_context)
    if args.timed_context in args.contexts:  # its prefilled point is the timed workload; a synthetic one checks it
        byte_contexts += (("synthetic", args.timed_context),)
    setup = Setup(args.rounds, args.timed_context, tuple(sorted(byte_contexts, key=lambda p: p[1])))
    results = run_ranks(worker, TP, setup, timeout_s=900, pg_timeout_s=120)
    wall = time.perf_counter() - start

    for rank, res in enumerate(results):
        off, on = res["off"]["outputs"], res["kvpp"]["outputs"]
        if off != on:
            differing = [name for name in off if off[name] != on[name]]
            raise SystemExit(f"rank {rank}: KVPP changed the greedy tokens of {differing}; no figures reported.")

    rows = byte_rows(cfg, setup, [res["kvpp"]["steps"] for res in results])
    for row in rows:
        r0 = row["ranks"][0]
        print(f"bytes per decode step at {tokens(row['context_tokens'])} context ({row['context']}, "
              f"{row['requests']} request(s), {r0['broadcast']['blocks_read']:.0f} of {r0['broadcast']['pool_blocks']} "
              f"blocks read): owner {r0['owner']['bytes'] / 2**10:.1f} KiB / broadcast "
              f"{r0['broadcast']['bytes'] / 2**20:.2f} MiB = {row['ratio']:.6f} (formula at the blocks read "
              f"{r0['formula_ratio_at_blocks_read']:.6f}, at {row['context_tokens']} tokens "
              f"{row['formula_ratio_at_context']:.6f}, ~H/N(q+out)/(context*latent) {row['approx_ratio']:.6f}); "
              f"every step equals the formula: {row['every_step_matches_formula']}; "
              f"ranks agree: {row['ranks_agree']}")

    timing = {}
    for rank, res in enumerate(results):
        off_steps = [s for s in res["off"]["steps"] if s["phase"] == "timed"]
        on_steps = [s for s in res["kvpp"]["steps"] if s["phase"] == "timed"]
        if [s["requests"] for s in off_steps] != [s["requests"] for s in on_steps]:
            raise SystemExit(f"rank {rank}: the two engines scheduled different timed steps.")
        replicated = summary([s["seconds"] for s in off_steps])
        modes = {}
        for mode in TIMED_MODES:
            times = summary([s["seconds"] for s in on_steps if s["asked"] == mode])
            # the replicated run's steps at the same positions, for a comparison at identical contexts
            paired = summary([s["seconds"] for s, o in zip(off_steps, on_steps) if o["asked"] == mode])
            modes[mode] = {"decode_step_s": times, "ratio_of_medians": times["median"] / replicated["median"],
                           "replicated_same_steps_s": paired}
        auto_decode = [s["mode"] for s in on_steps if s["asked"] == "auto"]
        auto_prefill = [s["mode"] for s in res["kvpp"]["steps"] if s["phase"] == "prefill" and s["asked"] == "auto"]
        timing[rank] = {"replicated_decode_step_s": replicated, "modes": modes,
                        "auto_chose_decode": auto_decode, "auto_chose_prefill": auto_prefill,
                        "runtime_modes": res["kvpp"]["modes"],
                        "timed_steps": [{"asked": o["asked"], "mode": o["mode"], "seconds": o["seconds"],
                                         "replicated_seconds": s["seconds"]} for s, o in zip(off_steps, on_steps)],
                        "engine_wall_s": {"off": res["off"]["wall_s"], "kvpp": res["kvpp"]["wall_s"]}}
    t0 = timing[0]
    print(f"decode step at {tokens(setup.timed_context)} context, {TIMED_REQUESTS} requests, {args.rounds} steps "
          f"per mode (rank 0): replicated {t0['replicated_decode_step_s']['median'] * 1e3:.1f} ms")
    for mode in TIMED_MODES:
        m = t0["modes"][mode]
        s = m["decode_step_s"]
        print(f"  KVPP {mode:>9}: {s['median'] * 1e3:.1f} ms [{s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}] -> "
              f"{m['ratio_of_medians']:.2f}x of replicated (goal <= {GOAL:.2f}; rank 1 "
              f"{timing[1]['modes'][mode]['ratio_of_medians']:.2f}x)")
    print(f"auto chose, decode steps: {sorted(set(t0['auto_chose_decode']))} "
          f"({t0['auto_chose_decode'].count('owner')} owner of {len(t0['auto_chose_decode'])}); prefill steps: "
          f"{t0['auto_chose_prefill'].count('broadcast')} broadcast of {len(t0['auto_chose_prefill'])}")
    met = all(t0["modes"][m]["ratio_of_medians"] <= GOAL for m in ("owner", "auto"))
    print(f"goal owner/auto <= {GOAL:.2f}: {'met' if met else 'MISSED'}; greedy tokens of every request equal "
          f"KVPP off; wall {wall:.0f} s")

    write_result("owner_mode", {
        "preset": PRESET, "tp": TP, "graph_mode": "piecewise", "inner": "eager", "token_budget": TOKEN_BUDGET,
        "block_size": BLOCK_SIZE, "pool_blocks": setup.pool_blocks, "max_model_len": setup.max_model_len,
        "rounds": args.rounds, "warmup_rounds": WARMUP_ROUNDS,
        "bytes": rows, "timed_context_tokens": setup.timed_context, "timed_requests": TIMED_REQUESTS,
        "timing": {str(k): v for k, v in timing.items()}, "goal_ratio": GOAL, "goal_met": met,
        "tokens_equal_kvpp_off": True, "wall_s": wall}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
