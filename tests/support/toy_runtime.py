"""A runtime over the toy spec, driven as a rewritten graph drives it, and bytes that tell where they came from."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ModelCacheSpec
from kvpp_fx.runtime.runtime import KVPPRuntime
from tests.support.specs import TOY_BLOCK, TOY_WIDTH, toy_spec

TOY_BLOCKS = 16  # blocks of a toy runtime's pool


def toy_runtime(group: Any, num_layers: int = 4, *, spec: ModelCacheSpec | None = None,
                layers: tuple[int, ...] | None = None, num_blocks: int = TOY_BLOCKS,
                scratch_blocks: int | None = None, **create: Any) -> KVPPRuntime:
    """A runtime over `group` (None: a group of one) for the toy spec (or `spec`), its plan restricted to
    `layers` if given; ``scratch_blocks`` makes its slots compact."""
    plan_options: dict[str, Any] = {"layers": layers, "scratch_blocks": scratch_blocks}
    size, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    plan = KVPPPlan(spec or toy_spec(num_layers), group_size=size, **plan_options)
    return KVPPRuntime.create(plan, allocate_cache(plan, rank, num_blocks), group, **create)


def run_layers(rt: KVPPRuntime, on_wait: Callable[[int, torch.Tensor], None] | None = None,
               after_prefetch: Callable[[int], None] | None = None, *, routed: bool = False) -> None:
    """Issue one forward's ops as the rewritten graph does (`KVPPPlan.schedule`): ``prefetch(first)``,
    then per layer ``wait(L)``, ``prefetch(next)`` and ``on_wait(L, view)``, where the layer's attention
    runs. ``after_prefetch(L)`` runs right after each prefetch returns."""
    schedule = rt.plan.schedule()
    for layer in (None, *schedule.target_layers):
        steps = (schedule.first(),) if layer is None else schedule.at_layer(layer)
        view = None
        for step in steps:
            if step.kind == "wait":
                view = rt.wait(step.layer, step.slot, routed=routed).view
                continue
            rt.prefetch(step.layer, step.slot)
            if after_prefetch is not None:
                after_prefetch(step.layer)
        if layer is not None and on_wait is not None:
            on_wait(layer, view)


def pattern(forward: int, layer: int, num_blocks: int = TOY_BLOCKS) -> torch.Tensor:
    """The bytes the owner of `layer` writes in `forward`: distinct per forward, layer and position."""
    return (torch.arange(num_blocks * TOY_BLOCK * TOY_WIDTH, dtype=torch.float32) + forward * 10_000 + layer * 100
            ).view(num_blocks, TOY_BLOCK, TOY_WIDTH)


def write_owned(rt: KVPPRuntime, forward: int) -> None:
    """Every layer this rank owns gets `pattern(forward, layer)`."""
    for layer in rt.plan.owned_layers(rt.rank):
        rt.typed_views(layer)["kv"].copy_(pattern(forward, layer, rt.storage.num_blocks))
