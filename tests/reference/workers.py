"""Rank functions for the reference-model tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvpp_fx.reference.config import RefConfig
from kvpp_fx.reference.engine import EngineConfig, build_engine
from kvpp_fx.reference.model import TPInfo


def step_logits(rank: int, world: int, checkpoint: str, prompt: list[int], decode_steps: int):
    """Logits of the prompt's last token, then of each greedy decode step (reads the paged cache)."""
    tp = TPInfo(rank, world, dist.group.WORLD) if world > 1 else TPInfo()
    config = RefConfig.from_pretrained(checkpoint)
    engine = build_engine(config, engine_config=EngineConfig(graph_mode="none", token_budget=256),
                          num_blocks=16, tp=tp, checkpoint=checkpoint)
    request = engine.add_request(prompt, decode_steps + 1)
    logits = []
    with torch.no_grad():
        while not request.finished:
            engine.step()
            logits.append(engine.last_logits[0].clone())
    return {"logits": torch.stack(logits), "tokens": request.output}
