"""Rank function of the end-to-end tests: the workload through the step driver with KVPP on (and off)."""

from __future__ import annotations

import torch

from kvpp_fx.reference.config import load_config
from kvpp_fx.reference.generate import run_generation
from tests.faults import DroppedBroadcast
from tests.reference.helpers import shared_prefix_prompts

NEW_TOKENS = 16


def on_off(rank: int, world: int, preset: str, options: dict, with_off: bool = True, fault_layer: int | None = None):
    import kvpp_fx.ops as ops

    prompts = shared_prefix_prompts(load_config(preset).vocab_size)
    out = {"prompts": prompts}
    real_current_runtime = ops.current_runtime
    if fault_layer is not None:
        ops.current_runtime = lambda: DroppedBroadcast(real_current_runtime(), fault_layer)
    try:
        for kvpp in (False, True) if with_off else (True,):
            torch._dynamo.reset()
            out["on" if kvpp else "off"] = run_generation(rank, world, preset, prompts, NEW_TOKENS,
                                                          dict(options, kvpp=kvpp))
    finally:
        ops.current_runtime = real_current_runtime
    return out
