"""A row that reads a block its packed slot does not hold (`KVPPRuntime.check_reads`): on CPU a named error
before attention runs; on a device (a recording API whose checks are read later) no host read in the step,
and the same named error when the next forward begins, or at `settle`."""

from __future__ import annotations

import pytest
import torch

from kvpp_fx.runtime import errors as E
from kvpp_fx.runtime.device import DeferredRead
from tests.runtime.ordering import RecordingDeviceAPI
from tests.support.host_sync import HostSyncDetector
from tests.support.launch import kvpp_group, launch
from tests.support.specs import TOY_BLOCK
from tests.support.toy_runtime import run_layers, toy_runtime

pytestmark = pytest.mark.multirank

LISTED = [2, 5, 9]  # the forward's packed list: a slot of 6 holds them at positions 0..2


class _Completed:
    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class DeviceChecks(RecordingDeviceAPI):
    """The recording API with a device's checks: folded into the forward's flag, read later."""

    immediate_checks = False

    def read_later(self, value: torch.Tensor) -> DeferredRead:
        return DeferredRead(value.clone(), _Completed())


class EveryTensorRead(HostSyncDetector):
    """The host-sync detector over CPU tensors too: on this CPU stand-in for a device, any host read of a
    tensor inside the layers would be one (a `.to` of a tensor already there moves nothing)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and self._reads_host(func, args, kwargs):
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if not (func is torch.Tensor.to and torch.device(target) == args[0].device):
                self.reads.append(getattr(func, "__name__", repr(func)))
        return func(*args, **kwargs)


def unlisted_ranks(rank: int, world: int, device: bool, entry: int, read_at: str):
    api = DeviceChecks() if device else RecordingDeviceAPI()
    rt = toy_runtime(kvpp_group(world), 4, device_api=api, scratch_blocks=6)
    # two decode rows: row 0 reads 2 blocks (9 tokens), row 1 reads 1; row 1's second entry is padding
    table = torch.tensor([[2, entry], [5, 11]], dtype=torch.int32)
    seq_lens = torch.tensor([TOY_BLOCK + 1, TOY_BLOCK], dtype=torch.int32)
    detector = EveryTensorRead(strict=False)
    out = {}

    def attend(layer, view):
        with detector:
            turn = rt.open_turn
            if turn.packed is not None:  # an owned layer reads its own cache: nothing to check
                turn.packed.check_reads(layer, table, seq_lens)

    try:
        with rt.forward(has_history=True, blocks=LISTED):
            run_layers(rt, attend)
        out["step"] = "ok"
    except E.KVPPRuntimeError as exc:
        out["step"] = f"{type(exc).__name__}: {exc}"
    out["reads"], out["pending"] = detector.reads, rt.pending_checks
    try:
        if read_at == "settle":
            rt.settle()
        else:
            with rt.forward(has_history=False):
                run_layers(rt)
        out["later"] = "ok"
    except E.KVPPRuntimeError as exc:
        out["later"] = f"{type(exc).__name__}: {exc}"
    out["broken"] = rt.broken is not None
    rt.close()
    return out


@pytest.mark.parametrize("read_at", ["next-forward", "settle"])
def test_a_device_reads_an_unlisted_block_without_a_host_read_and_the_error_comes_one_step_later(read_at):
    for result in launch(unlisted_ranks, 2, True, 7, read_at, timeout_s=60):
        assert result["step"] == "ok" and result["reads"] == [] and result["pending"] == 1, result
        assert result["later"].startswith("UnlistedBlockError: a row of forward 1 read a block of a packed scratch "
                                          "slot that the forward did not list"), result["later"]
        assert result["broken"]


def test_the_same_step_with_every_read_block_listed_passes():
    """The control: entry 9 is listed; row 1's padding entry (block 11) is not read."""
    for result in launch(unlisted_ranks, 2, True, 9, "next-forward", timeout_s=60):
        assert result["step"] == "ok" and result["later"] == "ok" and not result["broken"], result


def test_on_cpu_the_error_is_raised_before_attention_runs():
    """Rank 1 reads layer 0 from its slot and raises there; rank 0 owns layers 0 and 1, and its broadcast
    of layer 2 then finds no peer."""
    owner, reader = launch(unlisted_ranks, 2, False, 7, "next-forward", timeout_s=60)
    assert reader["step"].startswith("UnlistedBlockError: layer 0: row 0 reads block-table entry 1 (block 7), "
                                     "which the forward's packed list does not hold"), reader["step"]
    assert owner["step"].split(":")[0] in ("UnlistedBlockError", "TransferFailedError"), owner["step"]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_hybrid_forwards_owner_rows_point_at_position_0_without_a_blocking_upload(device):
    """A hybrid forward's packed block table: the owner requests' rows point at position 0, which every slot
    holds (on CPU, the values); on a device (``meta``) nothing of the remap copies host values to the device
    in a way that waits for it, nor reads the device. The control: the detector sees such an upload."""
    from kvpp_fx.cache.allocate import allocate_cache
    from kvpp_fx.cache.cost import BROADCAST, OWNER
    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.runtime.active_blocks import PackedBlocks
    from kvpp_fx.runtime.device import DeviceAPI
    from kvpp_fx.runtime.packed_tables import PackedTables
    from tests.support.host_sync import MetaDeviceAPI
    from tests.support.specs import toy_spec

    plan = KVPPPlan(toy_spec(4), group_size=2, scratch_blocks=6)
    api = MetaDeviceAPI() if device == "meta" else DeviceAPI("cpu")
    storage = allocate_cache(plan, 1, 16, device=device)
    rows = [[9, 2], [2, 5], [5, -1]]  # request 1 goes to the owner: its row reads nothing here
    table = torch.tensor(rows, dtype=torch.int32).to(device)
    detector = HostSyncDetector()
    with detector:
        packed = PackedBlocks.prepare(LISTED, (), storage, api)
        (remapped,) = PackedTables(packed, api, (BROADCAST, OWNER, BROADCAST)).remap([table], ["block_table"])
    assert detector.reads == [] and detector.uploads == []
    if device == "cpu":  # blocks 2, 5, 9 at positions 0, 1, 2; padding stays
        assert remapped.tolist() == [[2, 0], [0, 0], [1, -1]]
    with pytest.raises(AssertionError, match="uploaded host values to meta with a blocking copy"), detector:
        torch.tensor([1], device="meta")
