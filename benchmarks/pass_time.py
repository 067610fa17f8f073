"""Time of the KVPP insert pass, split pass and verifier on a 61-layer graph, and their share of the compile.

The graph is the reference model's (tiny widths, 61 layers, DeepSeek-V3's depth). "compile" is the
first step's wall time (Dynamo tracing + our passes + the inner backend) minus the wall time of a later
step of the same shape (execution only). Everything is measured in one run.

    python benchmarks/pass_time.py [--layers 61] [--inner eager]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from kvpp_fx.reference.graphs import compile_reference


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--inner", default="eager", help="inner backend of the piecewise mode")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pass_time.json"))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = {}
    for mode in ("eager", "piecewise"):
        res = compile_reference("tiny", layers=args.layers, mode=mode, inner=args.inner)
        timings = res["record"].timings
        compile_s = res["compile_s"]
        ours = timings["insert_s"] + timings.get("split_s", 0.0) + timings["verify_s"]
        rows[mode] = {"insert_s": timings["insert_s"], "split_s": timings.get("split_s", 0.0),
                      "verify_s": timings["verify_s"], "inner_compile_s": timings.get("inner_compile_s", 0.0),
                      "compile_s": compile_s, "passes_share": ours / compile_s,
                      "graph_nodes": res["record"].graph_after.count("\n")}
        print(f"{mode:>9}: insert {timings['insert_s']*1e3:7.1f} ms  split {rows[mode]['split_s']*1e3:7.1f} ms  "
              f"verify {timings['verify_s']*1e3:7.1f} ms  compile {compile_s:6.2f} s  "
              f"passes share {rows[mode]['passes_share']:.1%}")
    result = {"benchmark": "pass_time", "layers": args.layers, "inner": args.inner, "modes": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
