"""Rank function of the end-to-end tests: the same workload with KVPP off, then on."""

from __future__ import annotations

import torch

from kvpp_fx.reference.config import load_config
from kvpp_fx.reference.generate import run_generation
from tests.reference.helpers import shared_prefix_prompts

NEW_TOKENS = 16


def on_off(rank: int, world: int, preset: str, options: dict):
    prompts = shared_prefix_prompts(load_config(preset).vocab_size)
    out = {}
    for kvpp in (False, True):
        torch._dynamo.reset()
        out["on" if kvpp else "off"] = run_generation(rank, world, preset, prompts, NEW_TOKENS,
                                                      dict(options, kvpp=kvpp))
    out["prompts"] = prompts
    return out
