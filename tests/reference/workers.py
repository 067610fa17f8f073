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


def modes_worker(rank: int, world: int, preset: str, options: dict, modes: tuple[str, ...], token_budget: int = 24,
                 new_tokens: int = 10):
    """The shared-prefix workload with KVPP off, then with KVPP on in each of `modes`; per step: logits,
    mode and bytes. One KVPP group of all ranks (TP = world). A mode "owner:<fault>" runs owner mode
    with the runtime's test fault <fault> (a negative control)."""
    import os

    from kvpp_fx.runtime.runtime import FAULT_ENV

    from kvpp_fx.reference.config import PRESETS
    from kvpp_fx.reference.generate import default_num_blocks
    from kvpp_fx.reference.workload import shared_prefix_prompts
    from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

    config = PRESETS[preset]
    prompts = shared_prefix_prompts(config.vocab_size)
    stage_groups = kvpp_groups(world, tp=world, pp=1)
    tp = TPInfo(rank, world, create_kvpp_process_groups(stage_groups))
    group = create_kvpp_process_groups(stage_groups)
    num_blocks = max(64, default_num_blocks(prompts, new_tokens, 16))
    out = {}
    for mode in ("off",) + tuple(modes):
        torch._dynamo.reset()
        kvpp_mode, _, fault = mode.partition(":")
        os.environ[FAULT_ENV] = fault  # read when the runtime is created
        engine_config = EngineConfig(token_budget=token_budget, kvpp_mode="broadcast" if mode == "off" else kvpp_mode,
                                     **options)
        engine = build_engine(config, engine_config=engine_config, num_blocks=num_blocks, kvpp=mode != "off",
                              tp=tp, kvpp_group=group)
        for prompt in prompts:
            engine.add_request(prompt, new_tokens)
        logits = []
        with torch.no_grad():
            while not all(r.finished for r in engine.requests):
                engine.step()
                logits.append(engine.last_logits.numpy().copy())  # by value: the rank exits before the parent reads
        out[mode] = {"outputs": [r.output for r in engine.requests], "logits": logits, "steps": engine.steps,
                     "stats": engine.runtime.stats(), "cached_tokens": [r.cached_tokens for r in engine.requests],
                     "drafts": [(r.drafts_proposed, r.drafts_accepted) for r in engine.requests]}
        engine.runtime.close()
    return out
