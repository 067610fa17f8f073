"""The benchmark tables, rendered from `benchmarks/results/*.json` and nothing else: every row in
docs/benchmarks.md, the headline rows (`HEADLINES`) in README.md.

    python benchmarks/report.py            # print the full table
    python benchmarks/report.py --write    # replace both tables between their markers
    python benchmarks/report.py --check    # exit 1 if either differs from the results

`make bench` reruns every benchmark and then writes the tables; a test checks that both files match
the result files, so a figure from older code cannot stay in either.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
DOC = HERE.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"
# The README's rows: the start of their "what" column.
SPARSE = "deepseek-v3.2"  # SFA: vLLM keeps whole-layer slots whatever the backend (planned per step elsewhere)
HEADLINES = ("capacity, deepseek-v3 TP 8", "capacity, deepseek-v4-flash TP 8",
             "capacity, vLLM tests' tiny DeepSeek TP 2 under vLLM's defaults",
             "vLLM prefill history", "transfer hidden, through the PIECEWISE-compiled model",
             "streamed prefill history hidden",
             "streamed prefill history hidden, as above with the side stream a thread",
             "bytes per decode step, owner / broadcast mode", "vLLM OpenAI server, tiny DeepSeek-V3",
             "vLLM decode step bytes per rank", "vLLM decode step bytes per rank, tiny DeepSeek-V3.2",
             "vLLM DeepSeek-V4 decode step bytes",
             "vLLM OpenAI server, tiny DeepSeek-V4",
             "vLLM prefill instance of a PD pair",
             "host time KVPP adds to a vLLM decode step, 256 requests x 2000")


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _defaults(plan: dict) -> str:
    """What vLLM's defaults (chunked prefill, prefix caching) get on the planned backends, each ratio once."""
    by_ratio: dict[str, list[str]] = {}
    for name, backend in plan.get("vllm_defaults", {}).items():
        if backend["capacity_ratio"] is not None and not plan["model"].startswith(SPARSE):
            by_ratio.setdefault(f"{backend['capacity_ratio']:.3f}x", []).append(name)
    return "".join(f"; vLLM's defaults on {' and '.join(names)}: {ratio}" for ratio, names in by_ratio.items())


def rows() -> list[tuple[str, str, str]]:
    out = []
    cap = _load("capacity")
    for r in cap["reference"]:
        c, w = r["compact"], r["whole_layer"]
        out.append((f"capacity, `small` TP {r['tp']}, {cap['kv_memory_bytes'] // 2**30} GiB per rank, real allocator",
                    f"{c['measured_ratio']:.3f}x with compact slots of {c['slot_blocks']} blocks (max model length "
                    f"{r['max_model_len']:,}, formula {c['formula_ratio']:.3f}x); {w['measured_ratio']:.3f}x with "
                    f"whole-layer slots (formula {w['formula_ratio']:.3f}x)", "`python benchmarks/capacity.py`"))
    tiny = cap["vllm_tiny"]
    out.append((f"capacity, vLLM tests' tiny DeepSeek TP 2, {cap['vllm_tiny_kv_memory_bytes'] // 2**20} MiB, real "
                "allocator", f"with MTP: {tiny['whole_layer']['measured_ratio']:.3f}x with whole-layer slots, "
                f"{tiny['compact']['measured_ratio']:.3f}x with compact slots of "
                f"{tiny['compact']['slot_blocks']} blocks (max model length {tiny['max_model_len']}); without, in "
                f"{cap['vllm_tiny_compact_kv_memory_bytes'] // 2**20} MiB: "
                f"{cap['vllm_tiny_compact']['compact']['measured_ratio']:.3f}x with compact slots of "
                f"{cap['vllm_tiny_compact']['compact']['slot_blocks']} blocks (max model length "
                f"{cap['vllm_tiny_compact']['max_model_len']}, token budget "
                f"{cap['vllm_tiny_compact']['token_budget']}: "
                "what vLLM runs on CPU_MLA), "
                f"{cap['vllm_tiny_compact']['whole_layer']['measured_ratio']:.3f}x with whole-layer slots", "same"))
    defaults = cap["vllm_tiny_defaults"]
    out.append((f"capacity, vLLM tests' tiny DeepSeek TP 2 under vLLM's defaults (chunked prefill, prefix caching), "
                f"{cap['vllm_tiny_defaults_kv_memory_bytes'] // 2**20} MiB, real allocator",
                f"with MTP {defaults['mtp']['compact']['measured_ratio']:.3f}x, without "
                f"{defaults['no_mtp']['compact']['measured_ratio']:.3f}x with compact slots of "
                f"{defaults['mtp']['compact']['slot_blocks']} blocks (max model length "
                f"{defaults['mtp']['max_model_len']}, "
                f"token budget {defaults['mtp']['token_budget']}; prefill history streams from the owners); "
                f"whole-layer "
                f"slots {defaults['mtp']['whole_layer']['measured_ratio']:.3f}x / "
                f"{defaults['no_mtp']['whole_layer']['measured_ratio']:.3f}x", "same"))
    for model in dict.fromkeys(p["model"] for p in cap["plans"]):
        for mtp in (False, True):
            plans = [p for p in cap["plans"] if p["model"] == model and p["mtp"] == mtp]
            if not plans:
                continue
            bounded = "; ".join(f"{p['capacity_ratio']:.3f}x at {p['max_model_len'] // 1024}K (S = {p['slot_blocks']}"
                                f"{_defaults(p)})" for p in plans if p["max_model_len"])
            whole = next(p for p in plans if not p["max_model_len"])
            out.append((f"capacity, {model}{' with MTP' if mtp else ''} TP 8, "
                        f"{cap['plan_kv_memory_bytes'] // 2**30} GiB, `kvpp-fx plan`",
                        f"{bounded}; {whole['capacity_ratio']:.3f}x without a bound (whole-layer slots, formula "
                        f"{whole['formula_ratio']:.3f}x)", "same"))
    for v4 in cap.get("layer_caches_plans", []):
        at = {c["context_tokens"]: c for c in v4["contexts"]}
        short, long = at[131072], at[1048576]
        out.append((f"capacity, {v4['model']} TP 8, {cap['plan_kv_memory_bytes'] // 2**30} GiB, {v4['kv_dtype']} "
                    "(five caches per layer in vLLM's packed pool, every row on its owner), `kvpp-fx plan`",
                    f"{v4['capacity_ratio']:.3f}x vLLM's blocks (blocks of {v4['worst_rank_block_bytes']:,} B on the "
                    f"busiest rank, {v4['packed_block_bytes']:,} B packed); requests per rank "
                    f"{short['replicated_requests']} -> {short['kvpp_requests']} at 128K, "
                    f"{long['replicated_requests']} -> {long['kvpp_requests']} at 1M; a decode token reads "
                    f"{_mib(short['decode_read_bytes'])} / {_mib(long['decode_read_bytes'])} of cache, owner mode "
                    f"ships {_mib(v4['owner_exchange_bytes_per_layer'])} per layer and non-owner rank", "same"))
    ph = _load("vllm_prefill_history")
    chunked, hit = ph["workloads"]["chunked"], ph["workloads"]["prefix_hit"]
    out.append((f"vLLM prefill history, tiny DeepSeek-V3 TP 2, a {chunked['prompt_tokens']}-token prompt in "
                f"{ph['token_budget']}-token chunks / a {hit['prefix_hit_tokens']}-token prefix hit, KVPP on "
                f"against off",
                f"bytes per rank {_mib(max(chunked['bytes_per_rank']))} / {_mib(max(hit['bytes_per_rank']))} "
                f"({'equal to' if ph['bytes_match_formula'] else 'NOT equal to'} the history read, once per layer; "
                f"whole-layer slots would move {_mib(chunked['whole_layer_slots_bytes_per_rank'])} / "
                f"{_mib(hit['whole_layer_slots_bytes_per_rank'])}); prefill time on / off "
                f"{chunked['on_over_off']:.2f}x / {hit['on_over_off']:.2f}x; chunks in flight before their call "
                f"{min(chunked['context_ahead_per_rank'])} of {max(chunked['context_chunks_per_rank'])} / "
                f"{min(hit['context_ahead_per_rank'])} of {max(hit['context_chunks_per_rank'])}",
                "`python benchmarks/vllm_prefill_history.py`"))
    ovl = _load("overlap")
    out.append((f"transfer hidden, runtime only, {ovl['layers']} x {ovl['layer_bytes'] // 2**20} MiB layers, "
                "sleep stand-in", f"{ovl['hidden_fraction_vs_compute']:.3f} (1 - exposed/transfer); "
                f"{ovl['hidden_fraction']:.3f} by (serial - overlapped)/transfer", "`python benchmarks/overlap.py`"))
    om = _load("overlap_model")
    out.append(("transfer hidden, through the PIECEWISE-compiled model", f"{om['hidden_fraction']:.3f} "
                f"(goal >= {om['goal']})", "`python benchmarks/overlap_model.py`"))
    ho = _load("history_overlap")
    idle = ho.get("idle_transfer_threads")
    out.append((f"streamed prefill history hidden, a {ho['history_tokens'] // 1024}K-token prefix hit in "
                f"{ho['chunk_tokens'] // 1024}K-token chunks, {ho['layers']} layers",
                f"{ho['hidden_fraction']:.3f} as (serial - prefetched) / transfer, serial being the same calls with "
                f"overlap=False (goal >= {ho['goal']}); against the path without a chunk plan the forward gains "
                f"{ho['gained_against_no_plan']:.3f} of its transfer; "
                f"{ho['transfer_not_waited_for']:.3f} of the transfer not waited for; gloo's launches, µs on a GPU, "
                f"stay on the host thread: {ho['launches_of_transfer']:.3f} of the transfer on these 2 CPU cores "
                f"(median launch {ho['median_launch_us']:.0f} µs; {ho['stalled_launches_of_transfer']:.3f} in launches "
                f"over {ho['stall_us']:.0f} µs, the host thread waiting for a core the sends hold); "
                f"{ho['found_in_flight_per_forward']:.0f} of {ho['chunks_per_forward']} chunks in flight before "
                f"their call"
                + (f"; run again with gloo's threads at idle priority, so that a transfer never keeps the host thread "
                   f"from a core (as a device's cannot): {idle['hidden_fraction']:.3f} hidden, "
                   f"{idle['transfer_not_waited_for']:.3f} not waited for, launches {idle['launches_of_transfer']:.3f} "
                   f"of the transfer ({idle['stalled_launches_of_transfer']:.3f} over {ho['stall_us']:.0f} µs)"
                   if idle else ""),
                "`python benchmarks/history_overlap.py`"))
    side = ho.get("side_stream_thread")
    if side and idle:
        out.append(("streamed prefill history hidden, as above with the side stream a thread (the host hands each "
                     "broadcast over, as to a device), gloo's threads idle",
                     f"{side['hidden_fraction']:.3f} (goal >= {ho['goal']}); {side['transfer_not_waited_for']:.3f} of "
                     f"the transfer not waited for; the hand-over {side['launches_of_transfer']:.3f} of the transfer "
                     f"(median {side['median_launch_us']:.0f} µs); a chunk's transfer "
                     f"{side['transfer_per_chunk_ms']:.2f} ms with the hand-over and the thread's wake-up "
                     f"({idle['transfer_per_chunk_ms']:.2f} ms idle, {ho['transfer_per_chunk_ms']:.2f} ms as is); "
                     f"the compute stand-in {side['compute_of_transfer']:.2f}x the timed transfer "
                     f"({idle['compute_of_transfer']:.2f}x idle, {ho['compute_of_transfer']:.2f}x as is)",
                     "`python benchmarks/history_overlap.py`"))
    ro = _load("runtime_overhead")
    out.append((f"runtime cost per layer, no-op transport, {ro['layers']} layers",
                f"{ro['us_per_layer_with_history']['median']:.1f} us with history "
                f"(goal <= {ro['goal_us_per_layer_with_history']:g} us), "
                f"{ro['us_per_layer_without_history']['median']:.1f} us without (median); plus one agreement "
                f"per forward, {ro['us_agreement_per_forward']['median']:.0f} us (its gloo all-reduce alone "
                f"{ro['us_agreement_all_reduce']['median']:.0f} us), checked before the first collective on CPU; "
                f"checked at the forward's end as on a device, the host waited "
                f"{ro['us_agreement_wait_at_forward_end']['median']:.0f} us there"
                + (f"; {ro['ratio_with_history']:.2f}x / {ro['ratio_without_history']:.2f}x the per-layer cost of "
                   f"{ro['baseline']['revision']}, side by side (goal <= {ro['goal_ratio']:g})"
                   if "baseline" in ro else ""),
                "`python benchmarks/runtime_overhead.py --baseline <worktree>`"))
    sh = _load("step_host_cost")
    for case, modes in sh["cases"].items():
        requests, history = case.split("x")
        out.append((f"host time KVPP adds to a vLLM decode step, {requests} requests x {history} history blocks",
                    ", ".join(f"{mode} {m['host_ms']:.2f} ms" for mode, m in modes.items())
                    + f"; host syncs per step: {max(m['syncs_per_step'] for m in modes.values())} "
                    f"(goals: owner <= {sh['goals']['owner_ms_at_256_requests']:g} ms at 256 requests, auto and "
                    f"broadcast <= {sh['goals']['auto_and_broadcast_ms_at_256x2000']:g} ms at 256 x 2000)",
                    "`python benchmarks/step_host_cost.py`"))
    ds = _load("decode_step")
    occ = ds["occupancy"]
    out.append((f"bytes broadcast per decode step, {ds['occupancy_blocks']}-block pool, 10 % / 100 % occupancy",
                f"{_mib(occ['10pct']['bytes_per_decode_step'])} / {_mib(occ['100pct']['bytes_per_decode_step'])}: "
                f"{ds['bytes_10pct_over_100pct']:.3f} (goal <= {ds['goal_bytes_10pct_over_100pct']})",
                "`python benchmarks/decode_step.py`"))
    for row in ds["rows"]:
        t = row["decode_step_s"]
        out.append((f"decode step KVPP / replicated, `small` TP 2, {row['kv_memory_bytes'] // 2**20} MiB, two short "
                    "prompts", f"{row['ratio_of_medians']:.2f}x with active blocks (goal <= {ds['goal_ratio']}); "
                    f"{row['ratio_of_medians_whole_layer']:.2f}x with whole layers (medians: replicated "
                    f"{t['replicated']['median'] * 1e3:.1f} ms, active {t['kvpp']['median'] * 1e3:.1f} ms, whole "
                    f"{t['kvpp_whole_layer']['median'] * 1e3:.1f} ms; bytes per step "
                    f"{_mib(row['bytes_per_decode_step']['kvpp'])} vs "
                    f"{_mib(row['bytes_per_decode_step']['kvpp_whole_layer'])})", "same"))
    om = _load("owner_mode")
    byte_rows = {}
    for row in om["bytes"]:  # a prefilled context over a synthetic one of the same length
        if row["context"] == "prefilled" or row["context_tokens"] not in byte_rows:
            byte_rows[row["context_tokens"]] = row
    points = [byte_rows[c] for c in sorted(byte_rows)]
    contexts = " / ".join(f"{r['context_tokens'] // 1024}k" for r in points)
    synthetic = [f"{r['context_tokens'] // 1024}k" for r in points if r["context"] == "synthetic"]
    out.append((f"bytes per decode step, owner / broadcast mode, `small` TP {om['tp']}, {contexts} context",
                " / ".join(f"{r['ratio']:.2e}" for r in points) + " (formula "
                + " / ".join(f"{r['ranks'][0]['formula_ratio_at_blocks_read']:.2e}" for r in points)
                + (f"; {', '.join(synthetic)} without prefill: blocks marked computed" if synthetic else "") + ")",
                "`python benchmarks/owner_mode.py`"))
    t = om["timing"]["0"]
    order = ("owner", "auto", "broadcast")
    chose = t["auto_chose_decode"]
    out.append((f"decode step, KVPP / replicated at {om['timed_context_tokens'] // 1024}k context, "
                f"{' / '.join(order)} mode (goal <= {om['goal_ratio']:.2f})",
                " / ".join(f"{t['modes'][m]['ratio_of_medians']:.2f}x" for m in order)
                + f" (medians: replicated {t['replicated_decode_step_s']['median'] * 1e3:.1f} ms, "
                + ", ".join(f"{m} {t['modes'][m]['decode_step_s']['median'] * 1e3:.1f} ms" for m in order)
                + f"; auto chose owner mode in {chose.count('owner')} of {len(chose)} decode steps)", "same"))
    ab = _load("active_blocks")
    cross = ab["crossover_fraction"]
    out.append((f"active-block crossover, {ab['pool_blocks']}-block pool, {ab['layer_bytes'] / 2**20:.1f} MiB layers",
                f"{cross:.2f} of the pool" if cross is not None else "none: active blocks never slower",
                "`python benchmarks/active_blocks.py`"))
    chunks = [r for r in ab["rows"] if r["fraction"] in (0.05, 0.2, 0.5)]
    out.append(("packed blocks vs the staged path (gather, broadcast, scatter), per forward of 2 layers",
                "; ".join(f"{r['blocks']} blocks ({r['active_bytes'] / 2**20:.2f} MiB, the same bytes): "
                          f"{r['active_s'] * 1e3:.1f} ms vs {r['staged_s'] * 1e3:.1f} ms "
                          f"({r['active_over_staged']:.2f}x)" for r in chunks), "same"))
    pt = _load("pass_time")
    for mode, m in pt["modes"].items():
        split = (f"; split {m['split_s'] * 1e3:.0f} ms (torch.fx split_module {m['split_module_s'] * 1e3:.0f} ms)"
                 if m["split_s"] else "")
        out.append((f"layer reading + insert + route + verify, {pt['layers']}-layer graph, {mode} mode",
                    f"{m['resolve_insert_route_verify_s'] * 1e3:.0f} ms (goal <= "
                    f"{pt['goal_resolve_insert_route_verify_s'] * 1e3:.0f} "
                    f"ms){split}; passes {m['passes_share']:.1%} of a {m['compile_s']:.1f} s compile",
                    "`python benchmarks/pass_time.py`"))
    out.append(_serving_row(_load("vllm_serving"), "`python benchmarks/vllm_serving.py`"))
    out.append(_serving_row(_load("vllm_serving_deepseek_v4"),
                            "`python benchmarks/vllm_serving.py --model deepseek-v4`"))
    pd = _load("pd_prefill")
    for connector, pair in pd["connectors"].items():
        off, on = pair["off"], pair["on"]
        out.append((f"vLLM prefill instance of a PD pair ({connector}, kv_producer), tiny DeepSeek-V3 with "
                    f"{pd['layers']} layers, TP {pd['tp']}, {pd['kv_memory_bytes'] // 2**20} MiB of KV per rank, "
                    f"{pd['requests']} requests over {pd['prefixes']} shared {pd['prefix_len']}-token prefixes, "
                    "KVPP off / on",
                    f"KV capacity {off['capacity_tokens']:,} / {on['capacity_tokens']:,} tokens "
                    f"({pair['capacity_ratio']:.2f}x); prefix cache hit rate {off['hit_rate']:.1%} / "
                    f"{on['hit_rate']:.1%}; median TTFT after the first {pd['prefixes']} requests "
                    f"{off['ttft_warm_s']['median'] * 1e3:.0f} / {on['ttft_warm_s']['median'] * 1e3:.0f} ms "
                    f"({pair['ttft_warm_ratio']:.2f}x) ({', '.join(on['attention_backends'])}, block "
                    f"{on['block_size']})",
                    "`python benchmarks/pd_prefill.py`"))
    hs = _load("hybrid_steps")
    pr, ps = hs["per_request"], hs["per_step"]
    out.append((f"reference engine, `{hs['preset']}` TP {hs['tp']}, a {hs['long']}-token prompt decoding next to "
                f"a {hs['short']}-token prompt's prefill chunks, auto per request / per step",
                f"mixed steps {pr['mixed_steps']}: {_mib(pr['mixed_bytes'])} / {_mib(ps['mixed_bytes'])} "
                f"({hs['mixed_bytes_ratio']:.3f}x; modes {', '.join(pr['mixed_step_modes'])} / "
                f"{', '.join(ps['mixed_step_modes'])}), step time {hs['mixed_step_time_ratio']:.2f}x; whole trace "
                f"{_mib(pr['total_bytes'])} / {_mib(ps['total_bytes'])}; tokens "
                f"{'equal' if pr['tokens_equal_kvpp_off'] and ps['tokens_equal_kvpp_off'] else 'DIFFER'} to KVPP off",
                "`python benchmarks/hybrid_steps.py`"))
    vo = _load("vllm_owner_mode")
    contexts = vo["contexts"]
    by = {(r["mode"], r["context"]): r for r in vo["rows"]}
    ratio = vo[f"bytes_ratio_{contexts[-1]}_over_{contexts[0]}"]
    step = vo[f"decode_step_over_off_at_{contexts[-1]}"]
    labels = " / ".join(f"{c // 1024}k" for c in contexts)
    out.append((f"vLLM decode step bytes per rank, tiny DeepSeek-V3 TP {vo['tp']}, after {labels}-token prompts, "
                "owner / broadcast mode",
                "; ".join(f"{_mib(max(by[('owner', c)]['bytes_per_rank']))} / "
                          f"{_mib(max(by[('broadcast', c)]['bytes_per_rank']))}" for c in contexts)
                + f" ({contexts[-1] // 1024}k / {contexts[0] // 1024}k: owner {ratio['owner']:.2f}x, broadcast "
                f"{ratio['broadcast']:.1f}x; owner bytes "
                f"{'equal' if vo['owner_bytes_match_formula'] else 'DIFFER FROM'}"
                f" the formula, broadcast {'within' if vo['broadcast_bytes_within_formula'] else 'OUTSIDE'} it)",
                "`python benchmarks/vllm_owner_mode.py`"))
    off_step = vo["off_decode_step_s"][str(contexts[-1])]
    out.append((f"vLLM decode step, KVPP / off at {contexts[-1] // 1024}k context, owner / broadcast mode",
                f"{step['owner']:.2f}x / {step['broadcast']:.2f}x (medians: off {off_step * 1e3:.1f} ms, owner "
                f"{by[('owner', contexts[-1])]['decode_step_s'] * 1e3:.1f} ms, broadcast "
                f"{by[('broadcast', contexts[-1])]['decode_step_s'] * 1e3:.1f} ms)", "same"))
    out.append(_deepseek_v32_row(_load("vllm_owner_mode_deepseek_v32")))
    out.append(_deepseek_v4_row(_load("vllm_deepseek_v4")))
    return out


def _deepseek_v32_row(vo: dict) -> tuple[str, str, str]:
    contexts = vo["contexts"]
    by = {(r["mode"], r["context"]): r for r in vo["rows"]}
    ratio = vo[f"bytes_ratio_{contexts[-1]}_over_{contexts[0]}"]
    step = vo[f"decode_step_over_off_at_{contexts[-1]}"]
    labels = " / ".join(f"{c // 1024}k" for c in contexts)
    return (f"vLLM decode step bytes per rank, tiny DeepSeek-V3.2 TP {vo['tp']} (index top-k 512; torch stand-ins "
            f"for vLLM's sparse kernels), after {labels}-token prompts, owner / broadcast mode (whole layers)",
            "; ".join(f"{_mib(max(by[('owner', c)]['bytes_per_rank']))} / "
                      f"{_mib(max(by[('broadcast', c)]['bytes_per_rank']))}" for c in contexts)
            + f" ({contexts[-1] // 1024}k / {contexts[0] // 1024}k: owner {ratio['owner']:.2f}x; owner bytes "
            f"{'equal' if vo['owner_bytes_match_formula'] else 'DIFFER FROM'} the formula); decode step KVPP / off "
            f"at {contexts[-1] // 1024}k: owner {step['owner']:.2f}x, broadcast {step['broadcast']:.2f}x (the "
            "stand-in indexer dominates a step here, and owner mode runs each layer's indexer on its owner only)",
            "`python benchmarks/vllm_owner_mode.py --model deepseek-v3.2 --contexts 1024,4096,8192`")


def _serving_row(vs: dict, command: str) -> tuple[str, str, str]:
    off, on = vs["off"], vs["on"]
    if vs.get("model") == "deepseek-v4":
        model = "tiny DeepSeek-V4 (ratios 0, 4, 128, 4; every row on its owner; prompts within the index top-k)"
        capacity = f"vLLM's blocks {off['kv_blocks']:,} / {on['kv_blocks']:,}"
    else:
        model = f"tiny DeepSeek-V3 with {vs['layers']} layers"
        capacity = f"KV capacity {off['kv_capacity_tokens']:,} / {on['kv_capacity_tokens']:,} tokens"
    return (f"vLLM OpenAI server, {model}, TP {vs['tp']}, {vs['kv_memory_bytes'] // 2**20} MiB of KV per rank, "
            f"{vs['requests']} concurrent {vs['input_len']}-token prompts, KVPP off / on",
            f"{capacity} ({vs['capacity_ratio']:.2f}x); requests running at once {off['max_running']} / "
            f"{on['max_running']}; preemptions {off['preemptions']} / {on['preemptions']}; output throughput "
            f"{off['output_throughput_tok_s']:.1f} / {on['output_throughput_tok_s']:.1f} tok/s; median TTFT "
            f"{off['median_ttft_ms'] / 1e3:.1f} / {on['median_ttft_ms'] / 1e3:.1f} s, TPOT "
            f"{off['median_tpot_ms']:.0f} / {on['median_tpot_ms']:.0f} ms; greedy outputs "
            f"{'equal' if vs['greedy_outputs_equal'] else 'DIFFER'} ({', '.join(vs['attention_backend'])})", command)


def _deepseek_v4_row(v4: dict) -> tuple[str, str, str]:
    by = {r["context"]: r for r in v4["rows"]}
    labels = " / ".join(f"{c // 1024}k" for c in v4["contexts"])
    return (f"vLLM DeepSeek-V4 decode step bytes per rank, tiny V4 (ratios 0, 4, 128, 4) TP {v4['tp']}, after "
            f"{labels}-token prompts, every row on its owner",
            "; ".join(f"{_mib(max(by[c]['bytes_per_rank']))} (a broadcast of the step's reads: "
                      f"{_mib(by[c]['broadcast_bytes'])})" for c in v4["contexts"])
            + f" (x{v4['bytes_ratio']:.2f}; {'equal to' if v4['bytes_match_formula'] else 'NOT equal to'} the "
            f"formula); vLLM's blocks at {v4['kv_memory_bytes'] // 2**20} MiB per rank {v4['num_blocks']['off']:,} / "
            f"{v4['num_blocks']['on']:,} ({v4['capacity_ratio']:.2f}x); decode step KVPP / off "
            f"{v4['decode_step_over_off']:.2f}x", "`python benchmarks/vllm_deepseek_v4.py`")


def table(headlines: bool = False) -> str:
    """Every row (``same`` naming the previous row's command), or the `HEADLINES` rows with their commands."""
    resolved, command = [], ""
    for what, figure, cmd in rows():
        command = command if cmd == "same" else cmd
        resolved.append((what, figure, cmd if not headlines else command))
    if headlines:  # a headline whose benchmark left no row (history_overlap --as-is-only) is left out
        firsts = (next((row for row in resolved if row[0].startswith(prefix)), None) for prefix in HEADLINES)
        resolved = [row for row in firsts if row is not None]
    lines = ["| what | figure | command |", "|---|---|---|"]
    lines += [f"| {what} | {figure} | {cmd} |" for what, figure, cmd in resolved]
    return "\n".join(lines)


def readme_table(text: str) -> str:
    """The table between the markers of a file's text."""
    try:
        start = text.index(BEGIN) + len(BEGIN)
        end = text.index(END)
    except ValueError:
        raise SystemExit(f"no {BEGIN} ... {END} block.") from None
    return text[start:end].strip("\n")


TARGETS = ((README, True), (DOC, False))  # (file, headlines only)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        print(table())
        return 0
    stale = []
    for path, headlines in TARGETS:
        text, rendered = path.read_text(), table(headlines)
        old = readme_table(text)
        if args.write:
            path.write_text(text.replace(f"{BEGIN}\n{old}\n{END}" if old else f"{BEGIN}\n{END}",
                                         f"{BEGIN}\n{rendered}\n{END}", 1))
            print(f"wrote the table into {path}")
        elif old != rendered:
            stale.append(str(path))
    if stale:
        print(f"the benchmark tables of {stale} differ from benchmarks/results; run `make bench`.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
