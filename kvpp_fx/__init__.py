"""kvpp-fx: KV layer parallelism (KVPP) for MLA/SFA models as a torch.fx pass plus a small runtime.

What a user of ``torch.compile(model, backend=kvpp_backend)`` needs, importable from here::

    from kvpp_fx import kvpp_backend, KVPPPlan, KVPPRuntime, AttentionOpSpec, ...

The names resolve on first use: ``import kvpp_fx`` itself imports no torch, so the vLLM plugin stays
cheap in every vLLM process (`kvpp_fx.integrations.vllm.plugin`).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    # compile
    "kvpp_backend": "kvpp_fx.backend",
    "KVPPBackend": "kvpp_fx.backend",
    # the layers, their caches and the plan
    "ModelCacheSpec": "kvpp_fx.cache.spec",
    "LayerCacheSpec": "kvpp_fx.cache.spec",
    "ComponentSpec": "kvpp_fx.cache.spec",
    "KVPPPlan": "kvpp_fx.cache.placement",
    "LayerSchedule": "kvpp_fx.schedule",
    "allocate_cache": "kvpp_fx.cache.allocate",
    "AttentionShape": "kvpp_fx.cache.cost",
    "StepLoad": "kvpp_fx.cache.cost",
    "LinkModel": "kvpp_fx.cache.cost",
    # the model's attention and cache ops
    "AttentionOpSpec": "kvpp_fx.passes.registry",
    "CacheOperand": "kvpp_fx.passes.registry",
    "TableOperand": "kvpp_fx.passes.registry",
    "HeadOperand": "kvpp_fx.passes.registry",
    "HeadSeparable": "kvpp_fx.passes.registry",
    "OwnerLocal": "kvpp_fx.passes.registry",
    "register_attention_op": "kvpp_fx.passes.registry",
    # the runtime
    "KVPPRuntime": "kvpp_fx.runtime.runtime",
    "DeviceAPI": "kvpp_fx.runtime.device",
    "default_device": "kvpp_fx.runtime.device",
    "process_group_backend": "kvpp_fx.runtime.device",
    "resolve_device_api": "kvpp_fx.runtime.device",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpp_fx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
