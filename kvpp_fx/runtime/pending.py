"""Checks a device computes in a forward and the host reads later, so that no step waits for the device.

On a device, three of a forward's checks are device values: whether every list of block ids a receiver
got was this forward's (`PackedBlocks.arrived`), whether an owner failed a layer (`OwnerExchange`'s
status values), and whether a row read a block of a packed slot that the forward did not list
(`PackedBlocks.unlisted_reads`). Reading them when the forward ends would make the host wait for the stream on every
step, and vLLM's asynchronous scheduling would gain nothing. So `Forward.end` folds them into one flag,
takes its maximum over the group (one small all-reduce on the stream: every rank's flag then says what
any rank saw, so the rank that hands on the step's tokens learns another rank's failure), and leaves it
here as a `DeferredRead` (a non-blocking copy into pinned memory behind an event):

- the next forward, when it begins, reads every flag whose event completed, and never waits;
- `settle(upto)` reads the flags of the forwards up to `upto`, waiting where an event has not
  completed: its caller calls it where the host has waited for the device anyway, before it uses those
  forwards' results (the vLLM integration: once vLLM has the step's sampled tokens on the host; with
  async scheduling, in vLLM's output thread);
- at most `MAX_PENDING` flags wait; an older one is read, waiting if it must, before a new one is left.

The flags are read under a lock: vLLM's output thread settles while the next step's forward begins.
A flag that reports a failure breaks the runtime with the check's named error, raised where it was
read: `BlockSetMismatchError` (a broadcast paired with another forward's), `OwnerRoutingError` (an owner
failed, and that layer's outputs are zeros) or `UnlistedBlockError` (a row read a block its slot did not
hold). On CPU the checks are read where they are computed
(`DeviceAPI.immediate_checks`) and nothing is left here.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from kvpp_fx.runtime.device import DeferredRead
from kvpp_fx.runtime.errors import BlockSetMismatchError, OwnerRoutingError, UnlistedBlockError
from kvpp_fx.runtime.health import Health

MISPAIRED, OWNER_FAILED, UNLISTED_READ = 1, 2, 4  # the flag's bits
BITS = (MISPAIRED, OWNER_FAILED, UNLISTED_READ)  # in `check_flag`'s order
MAX_PENDING = 4


def check_flag(device: torch.device, not_arrived: torch.Tensor | None, owners_failed: torch.Tensor | None,
               failed_here: bool, unlisted_reads: torch.Tensor | None = None) -> torch.Tensor:
    """One forward's device checks, built on the device: one int32 entry per bit of the flag (0 or 1), so
    that their maximum over the group keeps every rank's every failure; `folded` makes them one flag.
    `MISPAIRED` where a received block-id list was not the forward's (`not_arrived` true), `OWNER_FAILED`
    where an owner's status said it failed, or where this rank's own op failed as an owner (`failed_here`:
    the checks say only that), `UNLISTED_READ` where a row read a block its packed slot does not hold
    (`unlisted_reads` true)."""
    checks = torch.zeros(len(BITS), dtype=torch.int32, device=device)
    if failed_here:
        checks[1] = 1
        return checks
    for entry, failed in enumerate((not_arrived, None if owners_failed is None else owners_failed.reshape(()).ne(0),
                                    unlisted_reads)):
        if failed is not None:
            checks[entry].copy_(failed)
    return checks


def folded(checks: torch.Tensor) -> torch.Tensor:
    """`check_flag`'s entries (after their maximum over the group) as one int32 flag of bits, on the device.
    Each bit multiplies as a Python scalar: a tensor of the bits built from host values each forward would
    be a blocking upload, which waits for the device."""
    flag = checks[0] * BITS[0]
    for entry, bit in enumerate(BITS[1:], start=1):
        flag = flag + checks[entry] * bit
    return flag


FAILURES = (
    (MISPAIRED, lambda forward: BlockSetMismatchError(
        f"the block ids a rank received in forward {forward} were not that forward's set: a broadcast paired with "
        "another forward's or another rank's; this rank's view of the group can no longer be trusted.")),
    (OWNER_FAILED, lambda forward: OwnerRoutingError(
        f"an owner failed to compute a layer in forward {forward}; that layer's outputs are zeros.")),
    (UNLISTED_READ, lambda forward: UnlistedBlockError(
        f"a row of forward {forward} read a block of a packed scratch slot that the forward did not list (the "
        "step's host lists and the device's block tables disagree); its attention read another block's bytes, "
        "and that step's tokens must not be used.")),
)


class PendingChecks:
    """One runtime's flags not yet read, oldest first, with the number of the forward each came from."""

    def __init__(self, health: Health) -> None:
        self.health = health
        self._pending: deque[tuple[int, DeferredRead]] = deque()
        self._lock = threading.Lock()
        self.read = 0  # flags read so far (tests and benchmarks)

    def __len__(self) -> int:
        return len(self._pending)

    def leave(self, forward: int, flag: DeferredRead) -> None:
        if len(self._pending) >= MAX_PENDING:
            with self._lock:
                while len(self._pending) >= MAX_PENDING:
                    self._read_oldest()
        self._pending.append((forward, flag))  # one append: the readers pop under the lock

    def read_ready(self) -> None:
        """Read every flag whose event completed, oldest first; never waits (not even for the lock,
        which vLLM's output thread may hold while it waits for its step)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            while self._pending and self._pending[0][1].ready():
                self._read_oldest()
        finally:
            self._lock.release()

    def settle(self, upto: int | None = None) -> None:
        """Read the flags of forwards up to `upto` (None: all), waiting for each event that has not
        completed."""
        with self._lock:
            while self._pending and (upto is None or self._pending[0][0] <= upto):
                self._read_oldest()

    def _read_oldest(self) -> None:
        forward, flag = self._pending.popleft()
        value = flag.value()
        self.read += 1
        for bit, failure in FAILURES:  # the first that the flag holds names the cause
            if value & bit:
                self._pending.clear()
                raise self.health.broken_by(failure(forward))
