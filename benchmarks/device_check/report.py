"""The parent: run each check in its own ranks, judge, print one line per check, write the JSON."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import benchmarks.device_check as package
from benchmarks.device_check import (CHECKS, CPU_OVERHEAD, GPU_RESULT, LATE_MS, OVERLAP_GOAL, ROOT, SMOKE_RESULT,
                                     STALL_MS, WORLD)
from benchmarks.device_check.capture import capture_worker
from benchmarks.device_check.checks import (ORDER_SCENARIOS, end_to_end_worker, ordering_worker, overlap_worker,
                                            owner_kernels_worker)
from benchmarks.device_check.preflight import preflight, use_wheels


# --- the parent: run, judge, report ------------------------------------------------------------------------

@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    figure: str
    details: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"device-check {self.name}: {self.status} {self.figure}"


def _run(fn, *args, timeout_s: float, pg_timeout_s: float = 60.0) -> tuple[list[Any] | None, str | None]:
    """The ranks' results, or the reason there are none (a rank raised, died or ran out of time)."""
    from kvpp_fx.launch import RankFailure, run_ranks

    try:
        return run_ranks(fn, WORLD, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s), None
    except RankFailure as exc:
        return None, _first_words(str(exc))
    except Exception as exc:  # the launch itself failed
        return None, f"{type(exc).__name__}: {exc}"


def _first_words(failure: str) -> str:
    """Each failed rank's headline and the last line of its traceback, on one line."""
    blocks: list[list[str]] = []
    for line in filter(str.strip, failure.splitlines()):
        if line.startswith("rank ") or not blocks:
            blocks.append([line])
        else:
            blocks[-1].append(line)
    return " | ".join(" ".join(dict.fromkeys((block[0], block[-1]))) for block in blocks)


def judge_ordering(results: list[dict[str, Any]], cuda: bool) -> Check:
    problems, caught, exact, skipped = [], 0, 0, []
    for name, *_, control in ORDER_SCENARIOS:
        per_rank = [r["scenarios"][name] for r in results]
        if "skipped" in per_rank[0]:
            skipped.append(f"{name} ({per_rank[0]['skipped']})")
            continue
        wrong = sum(r["n_wrong"] or 0 for r in per_rank)
        errors = [r["error"] for r in per_rank if "error" in r]
        if control:
            dropped = sum(r["dropped_waits"] for r in per_rank)
            detected = wrong > 0 or bool(errors)
            caught += detected
            if cuda and not detected:
                problems.append(f"{name}: not caught ({dropped} waits dropped)")
        elif errors or wrong:
            problems.append(f"{name}: {errors[0] if errors else f'{wrong} reads differ'}")
        else:
            exact += 1
    controls = sum(1 for *_, c in ORDER_SCENARIOS if c)
    positives = len(ORDER_SCENARIOS) - controls
    details = {"ranks": results}
    skip_note = f"; skipped {'; '.join(skipped)}" if skipped else ""
    if problems:
        return Check("ordering", "FAIL", "; ".join(problems) + skip_note, details)
    stall = (f"{STALL_MS:g} ms compute stalls before every ready point, done point and read, or bytes "
             f"landing {LATE_MS:g} ms late" if cuda else "CPU smoke: bytes exact, streams and events are no-ops")
    if cuda:
        figure = f"{exact}/{positives} scenarios exact under {stall}; negative controls caught {caught}/{controls}"
    else:
        figure = f"{exact}/{positives} scenarios exact ({stall}); negative controls not meaningful on CPU " \
                 f"(caught {caught}/{controls})"
    if skipped and cuda:
        return Check("ordering", "FAIL", figure + skip_note, details)
    return Check("ordering", "PASS", figure + skip_note, details)


def judge_end_to_end(results: list[dict[str, Any]], cuda: bool, inner: str) -> Check:
    first = results[0]
    details = {"inner": inner, "ranks": results}
    per_mode = []
    for mode in first["modes"]:
        issues: dict[str, list[int]] = {}  # one message for the ranks that share it
        for rank, res in enumerate(results):
            for issue in _mode_issues(mode, res["runs"][mode]):
                issues.setdefault(issue, []).append(rank)
        run = first["runs"][mode]
        if issues:
            per_mode.append((False, f"{mode}: " + "; ".join(
                f"{issue} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
                for issue, ranks in issues.items())))
        else:
            note = (f", chose owner in {run['step_modes'].count('owner')} of {len(run['step_modes'])} steps"
                    if mode == "auto" else "")
            per_mode.append((True, f"{mode} identical (max |logit diff| {_fmt_diff(run['max_logit_diff'])}{note})"))
    missing = [m for m in ("broadcast", "owner", "auto") if m not in first["modes"]]
    if missing:
        per_mode.append((False, f"{', '.join(missing)} not run: gloo gather/scatter on the device: "
                                f"{first['probes']['gather']}; {first['probes']['scatter']}"))
    ok = all(passed for passed, _ in per_mode)
    figure = (f"tokens vs KVPP off ({first['off']['steps']} steps, TP {len(results)}, piecewise/{inner}, active "
              f"blocks): " + "; ".join(text for _, text in per_mode)
              + f"; KVPP off took {first['off_seconds']:.0f} s with its compiles" + ("" if cuda else " (CPU smoke)"))
    return Check("end_to_end", "PASS" if ok else "FAIL", figure, details)


def _mode_issues(mode: str, run: dict[str, Any]) -> list[str]:
    if "error" in run:
        return [f"raised at step {run['steps_done']}: {run['error']}"]
    issues = [] if run["identical"] else ["tokens differ from KVPP off"]
    if mode == "broadcast" and not (run["active_steps"] and run["broadcast_bytes"]):
        issues.append("no step moved active blocks")
    if mode == "owner" and set(run["step_modes"]) != {"owner"}:
        issues.append(f"steps ran {sorted(set(run['step_modes']))}")
    if mode == "auto" and set(run["step_modes"]) != {"broadcast", "owner"}:
        issues.append(f"chose only {sorted(set(run['step_modes']))}")
    return issues


def _fmt_diff(value: float | None) -> str:
    return "n/a (step shapes differ)" if value is None else f"{value:.1e}"


def judge_overlap(results: list[dict[str, Any]], cuda: bool) -> Check:
    res = results[0]["overlap"]
    hidden = res["hidden_fraction_vs_compute"]
    med = res["median_s"]
    figure = (f"{hidden:.3f} of the transfer hidden (1 - exposed/transfer; {res['hidden_fraction']:.3f} by "
              f"(serial - overlapped)/transfer) behind {res['matmuls_per_layer']} matmuls per layer, "
              f"{res['layers']} x {res['layer_bytes'] // 2**20} MiB layers; transfer {med['transfer'] * 1e3:.1f} ms, "
              f"overlapped {med['overlapped'] * 1e3:.1f} ms, compute {med['compute'] * 1e3:.1f} ms")
    details = {"ranks": [r["overlap"] for r in results], "goal": OVERLAP_GOAL}
    if not cuda:
        return Check("overlap", "PASS", figure + " (CPU smoke: gloo and the matmuls share the cores)", details)
    status = "PASS" if hidden >= OVERLAP_GOAL else "FAIL"
    return Check("overlap", status, f"{figure} (goal >= {OVERLAP_GOAL})", details)


def judge_host_time(results: list[dict[str, Any]], cuda: bool) -> Check:
    res = results[0]["host_time"]
    cpu = _cpu_overhead()
    on = "CUDA streams" if cuda else "CPU (smoke)"
    figure = (f"{res['us_per_layer_with_history']:.1f} us per layer with history, "
              f"{res['us_per_layer_without_history']:.1f} us without, on {on}, no-op transport, {res['layers']} "
              f"layers; CPU figure {cpu}")
    details = {"ranks": [r["host_time"] for r in results], "cpu_figure": cpu}
    if not cuda:
        return Check("host_time", "PASS", figure + "; CUDA syncs not counted on CPU", details)
    syncs = results[0]["syncs"]
    details["syncs"] = [r["syncs"] for r in results]
    in_layers = {path: max(r["syncs"][path]["in_layers"] for r in results) for path in syncs}
    per_forward = {path: max(r["syncs"][path]["per_forward"] for r in results) for path in syncs}
    figure += "; CUDA syncs on the forward's thread: " + ", ".join(
        f"{path} {in_layers[path]} in {syncs[path]['layers']} layers, {per_forward[path]} per forward"
        for path in syncs)
    return Check("host_time", "PASS" if not any(in_layers.values()) else "FAIL", figure, details)


def _cpu_overhead() -> str:
    try:
        ro = json.loads(CPU_OVERHEAD.read_text())
        return (f"{ro['us_per_layer_with_history']['median']:.1f} us with history, "
                f"{ro['us_per_layer_without_history']['median']:.1f} us without "
                f"(benchmarks/results/runtime_overhead.json)")
    except (OSError, KeyError, ValueError):
        return "unavailable (benchmarks/results/runtime_overhead.json unreadable)"


def judge_breakable_capture(results: list[dict[str, Any]], cuda: bool) -> Check:
    """KVPP's recorded cache write puts each replayed step's rows at that step's positions; the control (the
    write inside the graph) does not."""
    res = results[0]
    if "skipped" in res:
        return Check("breakable_capture", "SKIP", res["skipped"], res)
    kvpp, control = res["kvpp"], res["control"]
    ok = kvpp["ok"] and kvpp["eager_breaks"] == 1 and not control["ok"] and control["eager_breaks"] == 0
    steps = len(kvpp["steps"])
    line = (f"{res['capture']}: KVPP's eager cache write put {sum(s['values_ok'] for s in kvpp['steps'])}/{steps} "
            f"replayed steps' rows at their own slots; control (write inside the graph) caught: "
            f"{'yes' if not control['ok'] else 'no'} (wrote rows {control['steps'][0]['written']})")
    return Check("breakable_capture", "PASS" if ok else "FAIL", line, res)


def judge_owner_kernels(results: list[dict[str, Any]], cuda: bool) -> Check:
    """Owner calls on vLLM's GPU MLA kernels: each backend's owner call equals the ranks' own calls (bf16, each
    kernel's rounding; FLASHMLA_FP8: an fp8 cache and fp8 queries, the owner's own dense-fp8 plan), and
    FLASHMLA's shared metadata, the control, fails."""
    res = results[0]
    if "skipped" in res:
        return Check("owner_kernels", "SKIP", res["skipped"], res)
    parts, ok = [], True
    for backend, r in res.items():
        if "error" in r:
            ok = False
            parts.append(f"{backend}: {r['error']}")
            continue
        good = r["max_abs_diff"] <= 2e-2 and r["owner_metadata_own"] == backend.startswith("FLASHMLA")
        if backend == "FLASHMLA":
            good = good and r["shared_metadata"] != "ran"
        ok = ok and good
        parts.append(f"{backend} ran: owner call over {r['heads'][1]} heads vs {r['heads'][0]}-head calls, max |diff| "
                     f"{r['max_abs_diff']:.1e}" + (f"; control (one metadata for both): {r['shared_metadata']}"
                                                   if backend == "FLASHMLA" else ""))
    return Check("owner_kernels", "PASS" if ok else "FAIL", "; ".join(parts), res)


COULD_NOT_RUN = (
    "device ordering: on CPU streams and events are no-ops, so the stalls are absent and only the bytes "
    "were checked",
    "negative controls (transfer stream skips ready, compute stream skips done, exchanges skip Work.wait()): "
    "not meaningful on CPU",
    "gloo collectives on CUDA tensors",
    "inductor on CUDA (the smoke pass compiles the pieces with aot_eager on CPU)",
    "overlap behind real GPU compute",
    "host time with CUDA streams and the count of CUDA synchronisations",
    "breakable CUDA-graph capture and replay with KVPP's eager cache write",
    "owner calls on vLLM's GPU MLA kernels (TRITON_MLA's runs interpreted in make test)",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=package.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help=f"JSON result (default {GPU_RESULT} on a GPU, "
                                                    f"{SMOKE_RESULT} on the CPU smoke pass)")
    parser.add_argument("--wheels", default=str(ROOT / ".device-wheels"),
                        help="wheels of the pure-Python packages this interpreter may lack (make device-wheels)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole run")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--cpu", action="store_true", help="the CPU smoke pass even where a GPU is present")
    parser.add_argument("--inner", default=None,
                        help="end_to_end's inner backend (default: inductor on a GPU, aot_eager on CPU)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    deadline = began + args.budget_s
    wanted = [c for c in CHECKS if c in args.only.split(",")]
    unknown = sorted(set(args.only.split(",")) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; the checks are {', '.join(CHECKS)}")

    lacked = use_wheels(Path(args.wheels))
    cuda = torch.cuda.is_available() and not args.cpu
    device_type = "cuda" if cuda else "cpu"
    env = preflight(cuda)
    versions = env["versions"]
    where = versions.get("device", "CPU smoke pass, no GPU" if not args.cpu else "CPU smoke pass (--cpu)")
    wheels_note = f"; from the wheels: {', '.join(lacked)}" if lacked and not env["missing"] else ""
    pre = Check("preflight", "PASS" if env["ok"] else "FAIL",
                f"{where}; Python {versions['python']}, torch {versions['torch']}, triton {versions['triton']}"
                f"{wheels_note}" + ("" if env["ok"] else "; missing: " + "; ".join(env["missing"])
                                    + ("" if importlib.util.find_spec("pydantic") else
                                       f" (no wheels in {args.wheels}: run make device-wheels where pip reaches "
                                       "the index and bring the folder along)")), env)
    print(pre.line(), flush=True)
    checks = [pre]
    inner = args.inner or ("inductor" if cuda else "aot_eager")
    if env["ok"]:
        checks += run_checks(wanted, device_type, cuda, inner, deadline)
    else:
        for name in wanted:
            checks.append(Check(name, "FAIL", "not run: the preflight names what is missing"))
            print(checks[-1].line(), flush=True)
    duration = time.monotonic() - began
    print(f"device-check: {'GPU run' if cuda else 'smoke pass on CPU'} in {duration:.0f} s", flush=True)
    if not cuda:
        print("device-check: could not run here: " + "; ".join(COULD_NOT_RUN), flush=True)
    result = {"device": device_type, "smoke": not cuda, "duration_s": duration,
              "checks": {c.name: asdict(c) for c in checks},
              "summary": [c.line() for c in checks], "could_not_run": [] if cuda else list(COULD_NOT_RUN)}
    from benchmarks._common import write_result

    write_result("device_check", result, args.out or str(GPU_RESULT if cuda else SMOKE_RESULT))
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def run_checks(wanted: list[str], device_type: str, cuda: bool, inner: str, deadline: float) -> list[Check]:
    """Each check in its own ranks, so a crash or a hang in one costs only its own time."""
    out, overlap_results = [], None
    limits = {"ordering": 150.0, "overlap": 150.0, "host_time": 150.0}
    for name in wanted:
        left = deadline - time.monotonic() - 5.0
        if left < 20:
            check = Check(name, "FAIL" if cuda else "SKIP", f"not run: {max(0, int(left + 5))} s of the budget left")
        elif name == "ordering":
            check = _judged(name, _run(ordering_worker, device_type, timeout_s=min(left, limits[name])),
                            judge_ordering, cuda)
        elif name in ("overlap", "host_time"):
            if overlap_results is None:  # one launch measures both
                overlap_results = _run(overlap_worker, device_type, not cuda, timeout_s=min(left, limits[name]))
            check = _judged(name, overlap_results, judge_overlap if name == "overlap" else judge_host_time, cuda)
        elif name == "breakable_capture":
            check = _judged(name, _run(capture_worker, device_type, timeout_s=min(left, 120.0)),
                            judge_breakable_capture, cuda)
        elif name == "owner_kernels":
            check = _judged(name, _run(owner_kernels_worker, device_type, timeout_s=min(left, 150.0)),
                            judge_owner_kernels, cuda)
        else:
            check = _judged(name, _run(end_to_end_worker, device_type, inner, timeout_s=left, pg_timeout_s=180.0),
                            judge_end_to_end, cuda, inner)
        print(check.line(), flush=True)
        out.append(check)
    return out


def _judged(name: str, run: tuple[list[Any] | None, str | None], judge, *args: Any) -> Check:
    results, why = run
    if results is None:
        return Check(name, "FAIL", f"no result: {why}")
    try:
        return judge(results, *args)
    except Exception as exc:  # a result of an unexpected shape must not cost the other checks' report
        return Check(name, "FAIL", f"could not judge the result: {type(exc).__name__}: {exc}", {"ranks": results})


if __name__ == "__main__":
    sys.exit(main())
