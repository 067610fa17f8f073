"""Multi-rank tests: a rank function is a module-level function of the test module that uses it.

`launch` runs it on spawned gloo ranks (`kvpp_fx.launch.run_ranks`); inside a rank, `kvpp_group` and
`fresh_group` build the process group a runtime runs on (`tests.support.toy_runtime` the runtime).
Every rank must make the same calls in the same order (process groups are collective).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from kvpp_fx.launch import run_ranks
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups


def launch(fn: Any, world: int, *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on `world` spawned ranks; their results by rank (`run_ranks`)."""
    return run_ranks(fn, world, *args, timeout_s=timeout_s, **kwargs)


def kvpp_group(world: int, *, tp: int | None = None, pp: int = 1, timeout_s: float = 20.0,
               backend: str | None = None) -> Any:
    """This rank's KVPP group in a world of `world` ranks (TP = world unless given)."""
    groups = kvpp_groups(world, tp=tp if tp is not None else world, pp=pp)
    return create_kvpp_process_groups(groups, timeout=timedelta(seconds=timeout_s), backend=backend)


def fresh_group(world: int, timeout_s: float) -> Any:
    """A new group of all ranks, so that a test's stray collectives pair with nothing else."""
    return dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s))
