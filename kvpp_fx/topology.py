"""KVPP process groups from the [ExtDP, DP, PP, PCP, TP] rank grid.

Invariant: each group is the PCP x TP block of exactly one (ExtDP, DP, PP) coordinate, so a group
never crosses a pipeline stage or a data-parallel replica, and every rank is in exactly one group.
The grid is row-major with TP fastest, as in vLLM's and vllm-ascend's rank layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any


def kvpp_groups(
    world_size: int, tp: int, pp: int = 1, dp: int = 1, pcp: int = 1, external_dp: int = 1
) -> list[list[int]]:
    """The KVPP groups (global ranks, ascending) for a world laid out as [ExtDP, DP, PP, PCP, TP]."""
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp), ("dp", dp),
                        ("pcp", pcp), ("external_dp", external_dp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    expected = external_dp * dp * pp * pcp * tp
    if world_size != expected:
        raise ValueError(
            f"world_size {world_size} does not match external_dp*dp*pp*pcp*tp = "
            f"{external_dp}*{dp}*{pp}*{pcp}*{tp} = {expected}."
        )
    size = pcp * tp
    return [list(range(start, start + size)) for start in range(0, world_size, size)]


def group_of(rank: int, groups: Sequence[Sequence[int]]) -> list[int]:
    """The group that holds `rank`."""
    for group in groups:
        if rank in group:
            return list(group)
    raise ValueError(f"rank {rank} is in no KVPP group.")


def group_timeout(group: Any, device: Any = None) -> timedelta:
    """The timeout `group` was created with, read from its backend on `device` (by default the group's own
    device: an NCCL-only group has no CPU backend); torch's default when it cannot be read."""
    import torch.distributed as dist

    try:
        if device is None:
            device = dist.distributed_c10d._get_pg_default_device(group)
        return group._get_backend(device).options._timeout
    except Exception:  # private API: fall back rather than fail
        return dist.default_pg_timeout


def create_kvpp_process_groups(
    groups: Sequence[Sequence[int]], *, timeout: timedelta | None = None, backend: str | None = None
) -> Any:
    """Create every group with `torch.distributed.new_group` and return this rank's one.

    `new_group` is collective over the whole world, so every rank creates every group, in the same
    order, even the groups it is not a member of. Without `timeout` the groups get the world group's
    (``new_group`` alone would give torch's default of 30 minutes).
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    if timeout is None:
        timeout = group_timeout(dist.group.WORLD)
    mine = None
    for ranks in groups:
        handle = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        if rank in ranks:
            mine = handle
    if mine is None:
        raise ValueError(f"rank {rank} is in no KVPP group.")
    return mine
