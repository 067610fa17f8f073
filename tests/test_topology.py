import itertools

import pytest

from kvpp_fx.topology import group_of, kvpp_groups


def _coords(rank, ext, dp, pp, pcp, tp):
    """Decompose a rank on the [ExtDP, DP, PP, PCP, TP] grid (TP fastest)."""
    rank, t = divmod(rank, tp)
    rank, c = divmod(rank, pcp)
    rank, p = divmod(rank, pp)
    e, d = divmod(rank, dp)
    return e, d, p, c, t


@pytest.mark.parametrize("ext,dp,pp,pcp,tp", [
    (1, 1, 1, 1, 8), (1, 1, 2, 1, 2), (1, 2, 1, 1, 4), (1, 2, 2, 1, 2), (2, 1, 2, 2, 2), (1, 3, 2, 1, 1),
])
def test_groups_are_pcp_tp_blocks_of_one_stage_and_replica(ext, dp, pp, pcp, tp):
    world = ext * dp * pp * pcp * tp
    groups = kvpp_groups(world, tp=tp, pp=pp, dp=dp, pcp=pcp, external_dp=ext)
    assert len(groups) == ext * dp * pp
    assert sorted(itertools.chain(*groups)) == list(range(world))
    for group in groups:
        assert len(group) == pcp * tp
        stage_and_replica = {_coords(r, ext, dp, pp, pcp, tp)[:3] for r in group}
        assert len(stage_and_replica) == 1, f"group {group} crosses a stage or replica"
        assert {_coords(r, ext, dp, pp, pcp, tp)[3:] for r in group} == set(
            itertools.product(range(pcp), range(tp)))


def test_tp2_pp2_layout():
    assert kvpp_groups(4, tp=2, pp=2) == [[0, 1], [2, 3]]
    assert group_of(3, kvpp_groups(4, tp=2, pp=2)) == [2, 3]


def test_world_size_mismatch_is_named():
    with pytest.raises(ValueError, match=r"world_size 6 does not match .* = 8"):
        kvpp_groups(6, tp=4, pp=2)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        kvpp_groups(4, tp=0)


def group_timeouts(rank: int, world: int) -> list[float]:
    """The timeout of this rank's KVPP group, created without and with one (world group: 30 s)."""
    from datetime import timedelta

    import torch

    from kvpp_fx.topology import create_kvpp_process_groups

    inherited = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    given = create_kvpp_process_groups(kvpp_groups(world, tp=world), timeout=timedelta(seconds=7))
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in (inherited, given)]


@pytest.mark.multirank
def test_kvpp_groups_inherit_the_world_groups_timeout_unless_given_one():
    from kvpp_fx.launch import run_ranks

    # torch's new_group alone would give its 30-minute default: a stuck peer would hang the group that long
    assert run_ranks(group_timeouts, 2, timeout_s=60, pg_timeout_s=30.0) == [[30.0, 7.0]] * 2


def test_a_groups_timeout_is_read_on_its_own_device(monkeypatch):
    # An NCCL-only group has no CPU backend; NCCL cannot exist here, so the group is a stand-in that has a
    # backend on "cuda" only, and torch's lookup of the group's device is pointed at it.
    from datetime import timedelta

    import torch
    import torch.distributed.distributed_c10d as c10d

    from kvpp_fx.topology import group_timeout

    class CudaOnlyGroup:
        def _get_backend(self, device):
            if torch.device(device).type != "cuda":
                raise RuntimeError(f"no backend on {device}")
            return type("Backend", (), {"options": type("Options", (), {"_timeout": timedelta(seconds=42)})})()

    monkeypatch.setattr(c10d, "_get_pg_default_device", lambda group: torch.device("cuda"))
    assert group_timeout(CudaOnlyGroup()) == timedelta(seconds=42)
    assert group_timeout(CudaOnlyGroup(), torch.device("cpu")) == c10d.default_pg_timeout  # the control
