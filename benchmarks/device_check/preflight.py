"""The interpreter, its torch and what kvpp_fx needs of them, before any rank starts."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import platform
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.device_check import REQUIRED_MODULES


# --- environment ------------------------------------------------------------------------------------

def use_wheels(folder: Path) -> list[str]:
    """Make the packages of `folder`'s wheels importable when this interpreter lacks them.

    The device machine has no network: `make device-wheels` downloads the wheels here and they travel
    with the tree. They are unpacked once into a temporary folder put first on ``sys.path`` (spawned
    ranks inherit it). Returns the modules that were missing.
    """
    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not missing or not wheels:
        return missing
    digest = hashlib.sha1("".join(w.name for w in wheels).encode()).hexdigest()[:12]
    site = Path(tempfile.gettempdir()) / f"kvpp-device-site-{digest}"
    if not (site / ".complete").exists():
        partial = Path(tempfile.mkdtemp(prefix="kvpp-device-site-"))
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(partial)
        (partial / ".complete").touch()
        try:
            partial.rename(site)
        except OSError:  # another run unpacked the same wheels first
            pass
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return missing


def _has(path: str) -> bool:
    """Whether a dotted attribute path below ``torch`` (or an importable module) exists."""
    module, _, rest = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except Exception:
        return False
    for name in filter(None, rest.split(".")):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


# The torch APIs kvpp_fx and this script call that changed or appeared in recent releases.
TORCH_APIS = (
    ("torch:accelerator.current_accelerator", "kvpp_fx/runtime/device.py default_device"),
    ("torch:get_device_module", "kvpp_fx/runtime/device.py DeviceAPI"),
    ("torch.library:_register_effectful_op", "kvpp_fx/ops.py (kvpp ops are ORDERED-effectful)"),
    ("torch._library.effects:EffectType.ORDERED", "kvpp_fx/ops.py"),
    ("torch._dynamo.symbolic_convert:InstructionTranslator.current_tx", "kvpp_fx/backend.py"),
    ("torch._dynamo.backends.registry:lookup_backend", "kvpp_fx/backend.py"),
    ("torch._dynamo.backends.registry:register_backend", "kvpp_fx/backend.py"),
    ("torch._guards:detect_fake_mode", "kvpp_fx/backend.py"),
    ("torch._C:_TorchDispatchModeKey.FAKE", "kvpp_fx/ops.py RoutedOp"),
    ("torch._C:_get_dispatch_mode", "kvpp_fx/ops.py RoutedOp"),
    ("torch.library:custom_op", "kvpp_fx/reference/ops.py"),
    ("torch.distributed._functional_collectives:all_reduce", "kvpp_fx/reference/model.py TP"),
)
CUDA_APIS = (
    ("torch.cuda:_sleep", "the stalls of the ordering check"),
    ("torch.cuda:set_sync_debug_mode", "the sync count of host_time"),
    ("triton", "inductor's CUDA kernels (end_to_end)"),
)
KVPP_MODULES = ("kvpp_fx.backend", "kvpp_fx.reference.engine", "kvpp_fx.runtime.runtime", "kvpp_fx.launch")


def preflight(cuda: bool) -> dict[str, Any]:
    """What this interpreter has and lacks, named before anything deep can crash on it."""
    missing: list[str] = []
    for path, user in TORCH_APIS + (CUDA_APIS if cuda else ()):
        if not _has(path):
            missing.append(f"{path.replace(':', '.')} (used by {user})")
    if _has("torch:accelerator.current_accelerator"):
        if "check_available" not in inspect.signature(torch.accelerator.current_accelerator).parameters:
            missing.append("torch.accelerator.current_accelerator(check_available=...) (kvpp_fx/runtime/device.py)")
    if _has("torch.fx.passes.split_module:split_module"):
        from torch.fx.passes.split_module import split_module
        if "keep_original_order" not in inspect.signature(split_module).parameters:
            missing.append("split_module(keep_original_order=...) (kvpp_fx/passes/split.py)")
    if not dist.is_available() or not dist.is_gloo_available():
        missing.append("torch.distributed with gloo (both ranks)")
    for name in REQUIRED_MODULES + KVPP_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            missing.append(f"import {name}: {type(exc).__name__}: {exc}")
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "triton": _version("triton"), "pydantic": _version("pydantic"),
                "numpy": _version("numpy")}
    if cuda:
        try:
            versions["device"] = torch.cuda.get_device_name(0)
        except Exception as exc:
            missing.append(f"a usable CUDA device: {type(exc).__name__}: {exc}")
    return {"ok": not missing, "missing": missing, "versions": versions}


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except Exception:
        return None


