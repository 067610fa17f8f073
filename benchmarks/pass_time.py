"""Time of the KVPP insert pass, split pass and verifier on a 61-layer graph, and their share of the compile.

The graph is the reference model's (tiny widths, 61 layers, DeepSeek-V3's depth). Per mode:
- insert, route and verify: our passes over the graph (the goal: the three <= 50 ms);
- split (piecewise): ``assign`` (our piece assignment) + ``split_module`` (torch.fx's split_module,
  which builds one GraphModule per piece; run with ``--profile-split`` to see its top functions);
- codegen: regenerating the rewritten graph's Python code (what eager mode runs, and the dump);
- compile: the first step's wall time (Dynamo tracing + our passes + the inner backend) minus the wall
  time of a later step of the same shape (execution only).
Everything is measured in one run.

    python benchmarks/pass_time.py [--layers 61] [--inner eager] [--profile-split]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from kvpp_fx.reference.graphs import compile_reference

GOAL_S = 0.050


def profile_split(layers: int) -> str:
    """cProfile of one split of the rewritten graph: where split_module's time goes."""
    import cProfile
    import io
    import pstats

    import kvpp_fx.passes.manager as backend

    profile = cProfile.Profile()
    real = backend.split_pieces

    def profiled(gm):
        profile.enable()
        try:
            return real(gm)
        finally:
            profile.disable()

    backend.split_pieces = profiled
    try:
        compile_reference("tiny", layers=layers, mode="piecewise")
    finally:
        backend.split_pieces = real
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
    return out.getvalue()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--inner", default="eager", help="inner backend of the piecewise mode")
    parser.add_argument("--profile-split", action="store_true", help="print where split_module's time goes")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pass_time.json"))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = {}
    for mode in ("eager", "piecewise"):
        res = compile_reference("tiny", layers=args.layers, mode=mode, inner=args.inner)
        t = res["record"].timings
        compile_s = res["compile_s"]
        ours = t["insert_s"] + t["route_s"] + t.get("split_s", 0.0) + t["verify_s"] + t["codegen_s"]
        rows[mode] = {"insert_s": t["insert_s"], "route_s": t["route_s"], "verify_s": t["verify_s"],
                      "insert_route_verify_s": t["insert_s"] + t["route_s"] + t["verify_s"],
                      "split_s": t.get("split_s", 0.0), "split_assign_s": t.get("split_assign_s", 0.0),
                      "split_module_s": t.get("split_split_module_s", 0.0), "codegen_s": t["codegen_s"],
                      "inner_compile_s": t.get("inner_compile_s", 0.0), "compile_s": compile_s,
                      "passes_share": ours / compile_s, "graph_nodes": res["record"].graph_after.count("\n")}
        row = rows[mode]
        print(f"{mode:>9}: insert {row['insert_s']*1e3:6.1f} ms + route {row['route_s']*1e3:5.1f} ms + verify "
              f"{row['verify_s']*1e3:5.1f} ms = {row['insert_route_verify_s']*1e3:6.1f} ms (goal {GOAL_S*1e3:.0f} ms: "
              f"{'met' if row['insert_route_verify_s'] <= GOAL_S else 'MISSED'})  "
              f"split {row['split_s']*1e3:6.1f} ms (assign {row['split_assign_s']*1e3:.1f}, split_module "
              f"{row['split_module_s']*1e3:.1f})  codegen {row['codegen_s']*1e3:6.1f} ms  "
              f"compile {compile_s:6.2f} s  passes share {row['passes_share']:.1%}")
    result = {"benchmark": "pass_time", "layers": args.layers, "inner": args.inner, "goal_insert_route_verify_s": GOAL_S,
              "modes": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    if args.profile_split:
        print(profile_split(args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
