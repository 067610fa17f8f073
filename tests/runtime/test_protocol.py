"""The protocol state machine alone: plan data in, named errors out, no torch and no ranks."""

import subprocess
import sys

import pytest

from kvpp_fx.runtime import errors as E
from kvpp_fx.runtime.protocol import ProtocolState
from kvpp_fx.schedule import LayerSchedule

ORDER = LayerSchedule(target_layers=(0, 1, 2, 3), draft_layers=(4,), depth=2)


def run(state: ProtocolState, steps) -> None:
    for kind, layer, slot in steps:
        if kind == "prefetch":
            state.prefetch(layer, slot)
        else:
            state.wait(layer, slot)


def schedule_steps(schedule: LayerSchedule):
    return [(s.kind, s.layer, s.slot) for s in schedule.steps()]


@pytest.mark.parametrize("targets,depth", [((0, 1, 2, 3), 2), ((3, 5, 9), 3), ((7,), 2)])
def test_the_plans_schedule_is_accepted_and_completes(targets, depth):
    schedule = LayerSchedule(targets, depth=depth)
    state = ProtocolState(schedule)
    run(state, schedule_steps(schedule))
    assert state.unawaited() == [] and state.in_flight is None and state.last_awaited == targets[-1]


def test_negative_control_the_schedule_without_its_last_wait_is_incomplete():
    state = ProtocolState(ORDER)
    run(state, schedule_steps(ORDER)[:-1])
    assert state.unawaited() == [3] and state.in_flight == 3


@pytest.mark.parametrize("steps,error,message", [
    ([("prefetch", 0, 0), ("prefetch", 1, 1)], E.PrefetchPendingError, r"layer 1 \(slot 1\) while layer 0"),
    ([("prefetch", 0, 0), ("prefetch", 2, 0)], E.SlotBusyError, r"layer 2 \(slot 0\) while layer 0"),
    ([("prefetch", 0, 0), ("wait", 0, 0), ("prefetch", 1, 0)], E.SlotBusyError,
     "layer 1 into slot 0, which layer 0's attention is still reading"),
    ([("prefetch", 1, 0)], E.SlotMismatchError, "layer 1 uses slot 1, the graph asked for slot 0"),
    ([("prefetch", 4, 0)], E.UnknownLayerError, r"layer 4 is not a broadcast layer of this plan \(a local draft"),
    ([("prefetch", 9, 0)], E.UnknownLayerError, r"\(not a target layer; targets: \[0, 1, 2, 3\]\)"),
    ([("prefetch", 0, 0), ("wait", 0, 0), ("prefetch", 3, 1)], E.SkippedLayerError, r"skips layers \[1, 2\]"),
    ([("prefetch", 0, 0), ("wait", 0, 0), ("prefetch", 1, 1), ("wait", 1, 1), ("prefetch", 0, 0)],
     E.PrefetchOrderError, "layer 0 prefetched after layer 1"),
    ([("wait", 0, 0)], E.WaitMismatchError, "wait for layer 0, but nothing is pending"),
    ([("prefetch", 0, 0), ("wait", 1, 1)], E.WaitMismatchError, "wait for layer 1, but layer 0 is pending"),
    ([("prefetch", 0, 0), ("wait", 0, 1)], E.SlotMismatchError, "layer 0 uses slot 0"),
])
def test_each_rule_raises_its_named_error(steps, error, message):
    state = ProtocolState(ORDER)
    run(state, steps[:-1])  # everything before the faulty op is accepted
    with pytest.raises(error, match=message):
        run(state, steps[-1:])


def test_the_protocol_imports_no_torch():
    code = "import sys, kvpp_fx.runtime.protocol; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    control = "import sys, kvpp_fx.runtime.forward; sys.exit('torch' in sys.modules)"  # it does import torch
    assert subprocess.run([sys.executable, "-c", control]).returncode == 1
