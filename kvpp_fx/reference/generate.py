"""`generate`: greedy decoding of token-id prompts through the step driver, on 1 or N gloo ranks.

The recipe of one rank, which the demo, the tests and `generate` share: `rank_groups` (this rank's TP
group, KVPP group and pipeline link in a tp x pp world, created once per process), then `run_engine`
for each engine the rank runs on them (`build_engine`: model, cache, runtime, driver; then the prompts
to completion, and what a caller reads of the run).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from kvpp_fx.reference.config import PRESETS, RefConfig, load_config
from kvpp_fx.reference.engine import EngineConfig, PipelineLink, build_engine
from kvpp_fx.reference.model import PPInfo, TPInfo


def default_num_blocks(prompts: list[list[int]], max_new_tokens: int, block_size: int) -> int:
    per_request = [-(-(len(p) + max_new_tokens + 2) // block_size) for p in prompts]
    return sum(per_request) + 4


@dataclass(frozen=True)
class RankGroups:
    """One rank's place in a world of ``tp * pp`` ranks (every rank builds its own, in the same order)."""

    tp: TPInfo
    kvpp_group: Any  # None in a world of one
    pp: PPInfo
    link: PipelineLink | None


def rank_groups(rank: int, world: int, pp: int = 1, *, timeout: timedelta | None = None) -> RankGroups:
    """The TP group and the KVPP group of this rank's pipeline stage, and its pipeline link.

    The KVPP group has the TP group's ranks but is a communicator of its own, so its broadcasts do not
    queue behind the model's all-reduces. `timeout`: the groups' (None: torch.distributed's default).
    """
    from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

    if world % pp:
        raise ValueError(f"world size {world} is not a multiple of pp {pp}.")
    tp_size = world // pp
    tp, group = TPInfo(), None
    if world > 1:
        stage_groups = kvpp_groups(world, tp=tp_size, pp=pp)
        tp = TPInfo(rank % tp_size, tp_size, create_kvpp_process_groups(stage_groups, timeout=timeout))
        group = create_kvpp_process_groups(stage_groups, timeout=timeout)
    link = PipelineLink.for_rank(rank, tp_size, pp) if pp > 1 else None
    return RankGroups(tp, group, PPInfo(rank // tp_size, pp), link)


def run_engine(config: RefConfig, prompts: list[list[int]], max_new_tokens: int, *, engine_config: EngineConfig,
               groups: RankGroups, kvpp: bool, num_blocks: int | None = None, kv_memory: int | None = None,
               checkpoint: str | Path | None = None, timeline: Any = None, keep_logits: bool = False,
               max_steps: int = 10_000) -> dict[str, Any]:
    """This rank's engine on `groups` (`build_engine`: ``num_blocks`` blocks, or as many as ``kv_memory``
    bytes hold), then greedy tokens for `prompts` through it; its runtime is closed at the end.

    Returns the outputs, the runtime's stats, the step records, the pool's block count, each request's
    cached tokens and drafts (proposed, accepted), the folders the backend dumped graphs to and, with
    `keep_logits`, each step's logits (as numpy arrays, which cross process boundaries by value).
    """
    engine = build_engine(config, engine_config=engine_config, num_blocks=num_blocks, kv_memory=kv_memory, kvpp=kvpp,
                          tp=groups.tp, kvpp_group=groups.kvpp_group, checkpoint=checkpoint, pp=groups.pp,
                          link=groups.link, timeline=timeline)
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens)
    logits = []
    for _ in range(max_steps):
        if all(r.finished for r in engine.requests):
            break
        engine.step()
        if keep_logits:
            logits.append(engine.last_logits.numpy().copy())
    else:
        raise RuntimeError(f"requests did not finish within {max_steps} steps.")
    records = engine.backend.records if engine.backend is not None else []
    result = {"outputs": [r.output for r in engine.requests], "stats": engine.runtime.stats(), "steps": engine.steps,
              "num_blocks": engine.runtime.storage.num_blocks,
              "slot_blocks": engine.runtime.storage.slot_blocks if engine.plan.compact else None,
              "allocated_bytes": engine.runtime.storage.allocated_bytes,
              "cached_tokens": [r.cached_tokens for r in engine.requests],
              "drafts": [(r.drafts_proposed, r.drafts_accepted) for r in engine.requests],
              "dump_dirs": [str(r.dump_dir) for r in records if r.dump_dir is not None]}
    if keep_logits:
        result["logits"] = logits
    engine.runtime.close()
    return result


def run_generation(rank: int, world: int, model: str | Path, prompts: list[list[int]], max_new_tokens: int,
                   options: dict[str, Any]) -> dict[str, Any]:
    """One rank's part of `generate` (module level, so spawned ranks can import it): `run_engine` on
    this rank's groups. `options`: ``pp``, ``kvpp``, ``num_blocks`` and `EngineConfig` fields."""
    options = dict(options)
    pp = options.pop("pp", 1)
    kvpp = options.pop("kvpp", False)
    num_blocks = options.pop("num_blocks", None)
    engine_config = EngineConfig(**options)
    checkpoint = None if isinstance(model, str) and model in PRESETS else model
    return run_engine(load_config(model), prompts, max_new_tokens, engine_config=engine_config,
                      groups=rank_groups(rank, world, pp), kvpp=kvpp,
                      num_blocks=num_blocks or default_num_blocks(prompts, max_new_tokens, engine_config.block_size),
                      checkpoint=checkpoint)


def generate(model_dir_or_preset: str | Path, prompts: list[list[int]], max_new_tokens: int, *, tp: int = 1,
             pp: int = 1, kvpp: bool = False, block_size: int = 16, graph_mode: str | None = None, inner: Any = "eager",
             token_budget: int = 32, speculative: bool = False, num_blocks: int | None = None,
             active_blocks: bool = True, kvpp_mode: str = "broadcast", device_api: str | None = None,
             timeout_s: float = 600.0) -> list[list[int]]:
    """Greedy tokens for each prompt. Spawns ``tp * pp`` gloo ranks itself when that is more than one.

    With ``kvpp=True`` each step broadcasts only the blocks it reads (``active_blocks=False``: whole layers).
    ``kvpp_mode``: ``"broadcast"`` moves each layer's cache to the ranks, ``"owner"`` runs each layer's
    attention on its owner over every rank's heads, ``"auto"`` picks per step by the cost model.
    ``device_api``: ``"module:callable"`` building each rank's `DeviceAPI` from its cache's device (the
    tests' fault seam, `EngineConfig.device_api`).
    """
    options = {"kvpp": kvpp, "pp": pp, "block_size": block_size, "token_budget": token_budget, "inner": inner,
               "graph_mode": graph_mode or ("eager" if kvpp and tp > 1 else "none"),
               "speculative": speculative, "num_blocks": num_blocks, "active_blocks": active_blocks,
               "kvpp_mode": kvpp_mode, "device_api": device_api}
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
