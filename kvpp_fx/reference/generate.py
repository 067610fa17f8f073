"""`generate`: greedy decoding of token-id prompts through the step driver, on 1 or N gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvpp_fx.reference.config import PRESETS, RefConfig, load_config
from kvpp_fx.reference.engine import EngineConfig, build_engine


def default_num_blocks(prompts: list[list[int]], max_new_tokens: int, block_size: int) -> int:
    per_request = [-(-(len(p) + max_new_tokens + 2) // block_size) for p in prompts]
    return sum(per_request) + 4


def run_generation(rank: int, world: int, model: str | Path, prompts: list[list[int]], max_new_tokens: int,
                   options: dict[str, Any]) -> dict[str, Any]:
    """One rank's part of `generate` (module level, so spawned ranks can import it)."""

    from kvpp_fx.reference.engine import PipelineLink
    from kvpp_fx.reference.model import PPInfo, TPInfo
    from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

    options = dict(options)
    pp = options.pop("pp", 1)
    if world % pp:
        raise ValueError(f"world size {world} is not a multiple of pp {pp}.")
    config = load_config(model)
    checkpoint = None if isinstance(model, str) and model in PRESETS else model
    kvpp = options.pop("kvpp", False)
    num_blocks = options.pop("num_blocks", None) or default_num_blocks(prompts, max_new_tokens,
                                                                       options.get("block_size", 16))
    tp, group, link = TPInfo(), None, None
    tp_size = world // pp
    if world > 1:
        # The KVPP group has the TP group's ranks but is a communicator of its own, so its broadcasts
        # do not queue behind the model's all-reduces.
        stage_groups = kvpp_groups(world, tp=tp_size, pp=pp)
        tp = TPInfo(rank % tp_size, tp_size, create_kvpp_process_groups(stage_groups))
        group = create_kvpp_process_groups(stage_groups)
    if pp > 1:
        link = PipelineLink.for_rank(rank, tp_size, pp)
    engine = build_engine(config, engine_config=EngineConfig(**options), num_blocks=num_blocks, kvpp=kvpp,
                          tp=tp, kvpp_group=group, checkpoint=checkpoint, pp=PPInfo(rank // tp_size, pp), link=link)
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens)
    outputs = engine.run()
    stats = engine.runtime.stats()
    engine.runtime.close()
    return {"outputs": outputs, "stats": stats, "steps": engine.steps,
            "cached_tokens": [r.cached_tokens for r in engine.requests],
            "drafts": [(r.drafts_proposed, r.drafts_accepted) for r in engine.requests]}


def generate(model_dir_or_preset: str | Path, prompts: list[list[int]], max_new_tokens: int, *, tp: int = 1,
             pp: int = 1, kvpp: bool = False, block_size: int = 16, graph_mode: str | None = None, inner: Any = "eager",
             token_budget: int = 32, speculative: bool = False, num_blocks: int | None = None,
             active_blocks: bool = True, kvpp_mode: str = "broadcast", timeout_s: float = 600.0) -> list[list[int]]:
    """Greedy tokens for each prompt. Spawns ``tp * pp`` gloo ranks itself when that is more than one.

    With ``kvpp=True`` each step broadcasts only the blocks it reads (``active_blocks=False``: whole layers).
    ``kvpp_mode``: ``"broadcast"`` moves each layer's cache to the ranks, ``"owner"`` runs each layer's
    attention on its owner over every rank's heads, ``"auto"`` picks per step by the cost model.
    """
    options = {"kvpp": kvpp, "pp": pp, "block_size": block_size, "token_budget": token_budget, "inner": inner,
               "graph_mode": graph_mode or ("eager" if kvpp and tp > 1 else "none"),
               "speculative": speculative, "num_blocks": num_blocks, "active_blocks": active_blocks,
               "kvpp_mode": kvpp_mode}
    if isinstance(model_dir_or_preset, RefConfig):
        raise TypeError("pass a preset name or a HuggingFace model directory.")
    EngineConfig(kvpp_mode=kvpp_mode, block_size=block_size, token_budget=token_budget)  # bad values fail here
    world = tp * pp
    if world == 1:
        with torch.no_grad():
            return run_generation(0, 1, model_dir_or_preset, prompts, max_new_tokens, options)["outputs"]
    from kvpp_fx.launch import run_ranks

    results = run_ranks(run_generation, world, model_dir_or_preset, prompts, max_new_tokens, options,
                        timeout_s=timeout_s)
    outputs = [r["outputs"] for r in results]
    if any(o != outputs[0] for o in outputs):
        raise RuntimeError(f"ranks disagree on the generated tokens: {outputs}")
    return outputs[0]
