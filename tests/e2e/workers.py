"""Rank function of the end-to-end tests: the workload through the step driver with KVPP on (and off)."""

from __future__ import annotations

import torch

from kvpp_fx.reference.config import load_config
from kvpp_fx.reference.generate import run_generation
from tests.reference.helpers import shared_prefix_prompts

NEW_TOKENS = 16


class _DroppedBroadcast:
    """Fault: on a rank that does not own `layer`, its wait hands attention zeros instead of the
    broadcast bytes (as if the broadcast had been suppressed)."""

    def __init__(self, runtime, layer: int) -> None:
        self._runtime, self._layer = runtime, layer

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def wait(self, layer, slot):
        out = self._runtime.wait(layer, slot)
        if layer == self._layer and layer not in self._runtime.storage.persistent_layers:
            for view in self._runtime.typed_views(layer).values():
                view.zero_()
        return out


def on_off(rank: int, world: int, preset: str, options: dict, with_off: bool = True, fault_layer: int | None = None):
    import kvpp_fx.ops as ops

    prompts = shared_prefix_prompts(load_config(preset).vocab_size)
    out = {"prompts": prompts}
    real_current_runtime = ops.current_runtime
    if fault_layer is not None:
        ops.current_runtime = lambda: _DroppedBroadcast(real_current_runtime(), fault_layer)
    try:
        for kvpp in (False, True) if with_off else (True,):
            torch._dynamo.reset()
            out["on" if kvpp else "off"] = run_generation(rank, world, preset, prompts, NEW_TOKENS,
                                                          dict(options, kvpp=kvpp))
    finally:
        ops.current_runtime = real_current_runtime
    return out
