"""Shared helpers of the benchmark scripts: results folder and JSON output."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def write_result(name: str, result: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
              "machine": platform.machine(), **result}
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1], "n": len(ordered)}
