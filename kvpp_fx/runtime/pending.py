"""Checks a device computes in a forward and the host reads later, so that no step waits for the device.

On a device, two of a forward's checks are device values: whether every list of block ids a receiver
got was this forward's (`PackedBlocks.arrived`), and whether an owner failed a layer (`OwnerExchange`'s
status values). Reading them when the forward ends would make the host wait for the stream on every
step, and vLLM's asynchronous scheduling would gain nothing. So `Forward.end` leaves them here as
`DeferredRead`s (each a non-blocking copy into pinned memory behind an event), with no arithmetic on
the device:

- the next forward, when it begins, reads every flag whose event completed, and never waits;
- `settle` reads them all, waiting where an event has not completed: its caller calls it where the
  host has waited for the device anyway, before it uses the step's results (the vLLM integration: once
  vLLM has its sampled tokens on the host);
- at most `MAX_PENDING` forwards' checks wait; an older one is read, waiting if it must, before a new
  one is left.

A check that reports a failure breaks the runtime with the check's named error, raised where it was
read: `BlockSetMismatchError` (a broadcast paired with another forward's) or `OwnerRoutingError` (an owner
failed, and this rank's outputs of that layer are zeros). On CPU the checks are read where they are
computed (`DeviceAPI.immediate_checks`) and nothing is left here.
"""

from __future__ import annotations

from collections import deque

from kvpp_fx.runtime.device import DeferredRead
from kvpp_fx.runtime.errors import BlockSetMismatchError, OwnerRoutingError
from kvpp_fx.runtime.health import Health

MAX_PENDING = 4


class PendingChecks:
    """One runtime's checks not yet read, oldest first: the forward's number, whether every list of ids
    that arrived was the forward's (None: nothing arrived), and the maximum of the owners' status values
    (None: no exchange)."""

    def __init__(self, health: Health) -> None:
        self.health = health
        self._pending: deque[tuple[int, DeferredRead | None, DeferredRead | None]] = deque()
        self.read = 0  # forwards' checks read so far (tests and benchmarks)

    def __len__(self) -> int:
        return len(self._pending)

    def leave(self, forward: int, arrived: DeferredRead | None, status: DeferredRead | None) -> None:
        while len(self._pending) >= MAX_PENDING:
            self._read_oldest()
        self._pending.append((forward, arrived, status))

    def read_ready(self) -> None:
        """Read every forward's checks whose events completed, oldest first; never waits."""
        while self._pending and all(read is None or read.ready() for read in self._pending[0][1:]):
            self._read_oldest()

    def settle(self) -> None:
        """Read every flag, waiting for each event that has not completed."""
        while self._pending:
            self._read_oldest()

    def _read_oldest(self) -> None:
        forward, arrived, status = self._pending.popleft()
        mispaired = arrived is not None and not arrived.value()
        failed = status is not None and status.value() != 0
        self.read += 1
        if mispaired:
            self._pending.clear()
            raise self.health.broken_by(BlockSetMismatchError(
                f"the block ids received in forward {forward} are not that forward's set: a broadcast paired with "
                "another forward's or another rank's; this rank's view of the group can no longer be trusted."))
        if failed:
            self._pending.clear()
            raise self.health.broken_by(OwnerRoutingError(
                f"an owner failed to compute a layer in forward {forward}; this rank's outputs of that layer are "
                "zeros."))
