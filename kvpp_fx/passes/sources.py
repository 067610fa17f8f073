"""The source files whose code decides what a rewritten graph holds, and their hash (plain Python: vLLM's
engine process computes it when it builds a config, before any worker imports torch).

`PassManager.uuid` hashes each pass's own file (`file_uuid`) with its configuration; `source_uuid` hashes
every file here, and keys vLLM's compile caches (`kvpp_fx.integrations.vllm.compile_modes`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]

# Relative to the package root; a folder stands for every .py file under it.
PIPELINE_SOURCES = ("__init__.py", "schedule.py", "ops.py", "backend.py", "passes", "cache/placement.py",
                    "integrations/vllm/compilation.py", "integrations/vllm/compile_modes.py")


def file_uuid(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def source_uuid(root: Path = PACKAGE_ROOT) -> str:
    """sha256 of the pipeline's sources under a kvpp_fx package `root` (their paths and bytes), 16 hex digits."""
    files = []
    for entry in PIPELINE_SOURCES:
        path = root / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
