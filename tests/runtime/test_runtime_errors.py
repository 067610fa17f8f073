"""Named protocol errors of the runtime, on a one-rank group (no communication needed)."""

import pytest
import torch

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.runtime import errors as E
from kvpp_fx.runtime.device import resolve_device_api
from kvpp_fx.runtime.runtime import KVPPRuntime, current_runtime
from kvpp_fx.schedule import LayerSchedule
from tests.support.specs import toy_spec
from tests.support.toy_runtime import toy_runtime


def make_runtime(num_layers=4, drafts=0):
    return toy_runtime(None, spec=toy_spec(num_layers, drafts), num_blocks=4)


def run_all(rt, layers):
    """The plan's schedule for its first layers `layers` (a prefix of the targets)."""
    LayerSchedule(tuple(layers), depth=rt.plan.depth).run(rt)


def test_a_correct_forward_passes_and_returns_the_views():
    with make_runtime() as rt:
        with rt.forward(has_history=True):
            assert current_runtime() is rt
            rt.prefetch(0, 0)
            view = rt.wait(0, 0).view
            assert view.data_ptr() == rt.view(0).data_ptr()
            rt.prefetch(1, 1)
            rt.wait(1, 1)
            rt.prefetch(2, 0)
            rt.wait(2, 0)
            rt.prefetch(3, 1)
            rt.wait(3, 1)
        stats = rt.stats()
        assert stats["forwards"] == 1 and stats["last_forward"]["broadcasts"] == 0  # a group of one moves nothing


def test_ops_outside_a_forward():
    with make_runtime() as rt:
        with pytest.raises(E.NoActiveForwardError):
            rt.prefetch(0, 0)
        with pytest.raises(E.NoActiveForwardError):
            rt.wait(0, 0)
    with pytest.raises(E.NoActiveForwardError):
        current_runtime()


def test_wait_for_a_layer_that_is_not_pending_names_both():
    with make_runtime() as rt:
        with pytest.raises(E.WaitMismatchError, match="wait for layer 1, but layer 0 is pending"):
            with rt.forward(has_history=True):
                rt.prefetch(0, 0)
                rt.wait(1, 1)
        with pytest.raises(E.WaitMismatchError, match="wait for layer 0, but nothing is pending"):
            with rt.forward(has_history=True):
                rt.wait(0, 0)


def test_prefetch_while_pending_and_slot_busy():
    with make_runtime() as rt:
        with pytest.raises(E.PrefetchPendingError, match="layer 1 .* while layer 0 .* still pending"):
            with rt.forward(has_history=True):
                rt.prefetch(0, 0)
                rt.prefetch(1, 1)
        with pytest.raises(E.SlotBusyError, match="prefetch of layer 2 \\(slot 0\\) while layer 0"):
            with rt.forward(has_history=True):
                rt.prefetch(0, 0)
                rt.prefetch(2, 0)


def test_prefetch_into_the_slot_the_last_awaited_layer_reads():
    # The hazard is the slot layer 0's attention is still reading, not the (empty) pending one.
    with make_runtime() as rt:
        with pytest.raises(E.SlotBusyError, match="layer 1 into slot 0, which layer 0's attention is still reading"):
            with rt.forward(has_history=True):
                rt.prefetch(0, 0)
                rt.wait(0, 0)
                rt.prefetch(1, 0)


def test_slot_that_disagrees_with_the_plan():
    with make_runtime() as rt:
        with pytest.raises(E.SlotMismatchError, match="layer 1 uses slot 1, the graph asked for slot 0"):
            with rt.forward(has_history=True):
                rt.prefetch(1, 0)


def test_out_of_order_prefetch():
    with make_runtime() as rt:
        with pytest.raises(E.PrefetchOrderError, match="layer 0 prefetched after layer 1"):
            with rt.forward(has_history=True):
                run_all(rt, [0, 1])
                rt.prefetch(0, 0)


def test_a_skipped_layer_raises_at_the_prefetch_that_skips_it():
    with make_runtime() as rt:
        with pytest.raises(E.SkippedLayerError, match=r"prefetch of layer 3 skips layers \[1, 2\]"):
            with rt.forward(has_history=True):
                rt.prefetch(0, 0)
                rt.wait(0, 0)
                rt.prefetch(3, 1)
        with pytest.raises(E.SkippedLayerError, match=r"prefetch of layer 1 skips layers \[0\]"):
            with rt.forward(has_history=True):
                rt.prefetch(1, 1)


def test_draft_layers_are_not_broadcast_layers():
    with make_runtime(drafts=1) as rt:
        with pytest.raises(E.UnknownLayerError, match="layer 4 is not a broadcast layer"):
            with rt.forward(has_history=True):
                rt.prefetch(4, 0)
        assert rt.view(4).numel() > 0  # the draft cache is still there, local


def test_skipped_layer_detected_at_exit():
    with make_runtime() as rt:
        with pytest.raises(E.SkippedLayerError, match=r"without awaiting layers \[2, 3\]"):
            with rt.forward(has_history=True):
                rt.prefetch(0, 0)
                rt.wait(0, 0)
                rt.prefetch(1, 1)
                rt.wait(1, 1)
        with pytest.raises(E.SkippedLayerError, match=r"\[3\]"):  # a prefetch never awaited
            with rt.forward(has_history=True):
                run_all(rt, [0, 1, 2])
                rt.prefetch(3, 1)


def test_an_exception_inside_the_forward_propagates_unmasked_and_resets_state():
    with make_runtime() as rt:
        with pytest.raises(KeyError, match="boom"):
            with rt.forward(has_history=True):
                rt.prefetch(0, 0)
                raise KeyError("boom")
        with rt.forward(has_history=False):  # the next forward starts clean
            run_all(rt, [0, 1, 2, 3])


def test_nested_forward_and_closed_runtime():
    rt = make_runtime()
    with rt.forward(has_history=False):
        with pytest.raises(E.NestedForwardError):
            with rt.forward(has_history=False):
                pass
        run_all(rt, [0, 1, 2, 3])
    rt.close()
    with pytest.raises(E.ForwardClosedError):
        with rt.forward(has_history=False):
            pass


def test_create_checks_group_and_storage():
    spec = toy_spec(4)
    plan2 = KVPPPlan(spec, group_size=2)
    with pytest.raises(ValueError, match="needs a process group"):
        KVPPRuntime.create(plan2, allocate_cache(plan2, 0, 4), None)
    plan1 = KVPPPlan(spec, group_size=1)
    with pytest.raises(ValueError, match="another plan"):
        KVPPRuntime.create(plan1, allocate_cache(KVPPPlan(spec, group_size=1), 0, 4))
    torch.testing.assert_close(allocate_cache(plan1, 0, 4).byte_view(0), torch.zeros(4 * 4 * 32, dtype=torch.uint8))


def test_sharded_draft_layers_are_refused_at_creation():
    plan = KVPPPlan(toy_spec(2, drafts=1), group_size=1, shard_draft_layers=True)
    with pytest.raises(E.UnsupportedPlanError, match="shard_draft_layers=True is a planning what-if"):
        KVPPRuntime.create(plan, allocate_cache(plan, 0, 4))


def test_a_group_of_one_ignores_the_block_set():
    """A group of one moves nothing, so ids it would not read (99 is past the pool) are not checked, and
    every view is the persistent cache. The control: a group of two checks them (`InvalidBlocksError`,
    tested with real ranks)."""
    with make_runtime(2) as rt:
        with rt.forward(has_history=True, blocks=[0, 99]):
            run_all(rt, [0, 1])
        last = rt.last_forward()
        assert (last["broadcasts"], last["bytes"], last["exchanges"]) == (0, 0, 0)
        assert rt.stats()["forwards"] == 1 and rt.broken is None


def test_a_device_api_named_by_a_string_is_built_on_the_cache_device():
    api = resolve_device_api("tests.support.faults:UnremappedTables", "cpu")
    assert type(api).__name__ == "UnremappedTables" and api.device == torch.device("cpu")
    with pytest.raises(ValueError, match="'module:callable'"):
        resolve_device_api("tests.support.faults.UnremappedTables", "cpu")
    with pytest.raises(TypeError, match="returned str, not a DeviceAPI"):
        resolve_device_api("builtins:str", "cpu")
