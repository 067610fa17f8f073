"""Compile the reference model once with `kvpp_backend` and hand back what the backend recorded.

Used by ``kvpp-fx graph`` and ``benchmarks/pass_time.py``. The graph does not depend on the group size
(slots are ``k % depth`` on every rank), so a one-rank runtime serves to trace it.
"""

from __future__ import annotations

import time
from typing import Any


from kvpp_fx.backend import KVPPBackend
from kvpp_fx.reference.config import load_config
from kvpp_fx.reference.engine import EngineConfig, build_engine


def compile_reference(preset: str = "tiny", *, layers: int | None = None, mode: str = "eager",
                      inner: Any = "eager", dump_dir: str | None = None, prompt_len: int = 20) -> dict[str, Any]:
    config = load_config(preset)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be positive, got {layers}.")
        config = config.replace(num_hidden_layers=layers, num_nextn_predict_layers=0)
    engine = build_engine(config, engine_config=EngineConfig(graph_mode=mode, inner=inner, dump_dir=dump_dir,
                                                             token_budget=prompt_len), num_blocks=8)
    engine.add_request(list(range(1, prompt_len + 1)), 2)
    start = time.perf_counter()
    engine.step()  # traces, rewrites and compiles, then runs the prefill
    first = time.perf_counter() - start
    engine.step()  # a decode: new shapes, so Dynamo compiles once more (with dynamic sizes)
    engine.add_request(list(range(prompt_len + 1, 2 * prompt_len + 1)), 1)
    start = time.perf_counter()
    engine.step()  # the same shape as the first step, no compile: the execution time alone
    execution = time.perf_counter() - start
    backend: KVPPBackend = engine.backend
    engine.runtime.close()
    return {"backend": backend, "record": backend.records[0], "first_step_s": first, "execution_s": execution,
            "compile_s": first - execution, "config": config}


def graph_text(result: dict[str, Any], mode: str) -> str:
    from kvpp_fx.passes.render import normalize_code

    record = result["record"]
    text = normalize_code(record.graph_after)
    if mode == "piecewise":
        text += "\n\n# pieces\n" + record.piece_summary
    if record.dump_dir is not None:
        text += f"\n\n# dump: {record.dump_dir}"
    return text
