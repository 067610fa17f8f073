"""The source files whose code decides what a rewritten graph holds, and their hash: the key of vLLM's
compile caches (plain Python: vLLM's engine process computes it when it builds a config, before any
worker imports torch).

Invariant: `PIPELINE_SOURCES` covers every module the passes import, directly or not (the runtime,
which runs the rewritten graph, is never among them: no pass imports it), and the two drivers that
build the passes' configuration (`backend.py`, the vLLM integration's `attention/compilation.py`); a
test walks the passes' imports and fails on a module the list misses. `source_uuid` hashes every
covered file, so any change to the code that decides what a rewritten graph holds changes the key
(`kvpp_fx.integrations.vllm.setup.compile_modes.compile_digest`). What the graph calls at run time (the
kvpp ops' implementations, `RoutedOp`) is looked up by name when a cached graph loads, so it runs as the
installed code has it and needs no key of its own. The configuration a compile runs with comes
from vLLM's own config, which vLLM hashes into the same key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]

# Relative to the package root; a folder stands for every .py file under it.
PIPELINE_SOURCES = ("__init__.py", "arguments.py", "schedule.py", "ops.py", "backend.py", "passes",
                    "cache/placement.py", "integrations/vllm/attention/compilation.py",
                    "integrations/vllm/setup/compile_modes.py")


def source_files(root: Path = PACKAGE_ROOT) -> list[Path]:
    """The files `PIPELINE_SOURCES` names under a kvpp_fx package `root`, in hashing order."""
    files = []
    for entry in PIPELINE_SOURCES:
        path = root / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def source_uuid(root: Path = PACKAGE_ROOT) -> str:
    """sha256 of the pipeline's sources under a kvpp_fx package `root` (their paths and bytes), 16 hex digits."""
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
