"""`PendingChecks` alone: a device's checks read later, in order, never waiting where it must not."""

from __future__ import annotations

import threading

import pytest
import torch

from kvpp_fx.runtime import errors as E
from kvpp_fx.runtime.device import DeferredRead
from kvpp_fx.runtime.health import Health
from kvpp_fx.runtime.pending import MAX_PENDING, MISPAIRED, OWNER_FAILED, PendingChecks


class Event:
    def __init__(self, done: bool) -> None:
        self.done, self.waits = done, 0

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def flag(value: int, done: bool = True) -> DeferredRead:
    return DeferredRead(torch.tensor(value, dtype=torch.int32), Event(done))


def test_the_next_forward_reads_what_completed_and_settle_reads_up_to_its_forward():
    checks = PendingChecks(Health(0))
    checks.leave(1, flag(0))
    late = flag(0, done=False)
    checks.leave(2, late)
    checks.leave(3, flag(0, done=False))
    checks.read_ready()  # forward 1's completed; forward 2's has not: it stops there, without waiting
    assert (len(checks), checks.read, late.event.waits) == (2, 1, 0)
    checks.settle(upto=2)  # waits for forward 2's only
    assert (len(checks), checks.read, late.event.waits) == (1, 2, 1)
    checks.settle()
    assert len(checks) == 0


@pytest.mark.parametrize("bits,error", [(MISPAIRED, E.BlockSetMismatchError), (OWNER_FAILED, E.OwnerRoutingError),
                                        (MISPAIRED | OWNER_FAILED, E.BlockSetMismatchError)])
def test_a_failed_check_breaks_the_runtime_where_it_is_read(bits, error):
    health = Health(0)
    checks = PendingChecks(health)
    checks.leave(1, flag(0))
    checks.leave(2, flag(bits))
    checks.leave(3, flag(0))
    with pytest.raises(error, match="forward 2"):
        checks.read_ready()
    assert isinstance(health.cause, error) and len(checks) == 0
    with pytest.raises(E.RuntimeBrokenError):
        health.check()
    # The control: passing flags break nothing.
    clean = PendingChecks(Health(0))
    clean.leave(1, flag(0))
    clean.settle()
    assert clean.health.cause is None


def test_at_most_max_pending_wait_and_the_oldest_is_read_first():
    checks = PendingChecks(Health(0))
    reads = [flag(0, done=False) for _ in range(MAX_PENDING + 1)]
    for number, read in enumerate(reads, 1):
        checks.leave(number, read)
    assert len(checks) == MAX_PENDING and reads[0].event.waits == 1 and reads[1].event.waits == 0


def test_the_next_forward_never_waits_for_the_output_threads_lock():
    """vLLM's output thread may hold the lock while it waits for its step; the next forward's read goes on."""
    checks = PendingChecks(Health(0))
    checks.leave(1, flag(0))
    held, release = threading.Event(), threading.Event()

    def output_thread():
        with checks._lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=output_thread)
    thread.start()
    held.wait(10)
    checks.read_ready()  # returns at once, reading nothing
    assert len(checks) == 1
    release.set()
    thread.join(10)
    checks.read_ready()
    assert len(checks) == 0


def test_the_groups_maximum_keeps_every_ranks_every_failure():
    """One rank read an unlisted block, another got a mispaired list and an owner's failure: the maximum
    over the group (entry by entry) and its fold keep all three bits; a plain maximum of two folded
    flags (4 against 3) would have kept one rank's."""
    import torch

    from kvpp_fx.runtime.pending import UNLISTED_READ, check_flag, folded

    one = check_flag(torch.device("cpu"), None, None, False, torch.tensor(True))
    other = check_flag(torch.device("cpu"), torch.tensor(True), torch.tensor([3]), False, torch.tensor(False))
    assert int(folded(one)) == UNLISTED_READ and int(folded(other)) == MISPAIRED | OWNER_FAILED
    assert int(folded(torch.maximum(one, other))) == MISPAIRED | OWNER_FAILED | UNLISTED_READ
    assert int(folded(check_flag(torch.device("cpu"), torch.tensor(True), None, True))) == OWNER_FAILED
