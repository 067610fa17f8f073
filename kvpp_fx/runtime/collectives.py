"""Issuing and completing the runtime's collectives, each bounded by the runtime's timeout.

Every collective the runtime makes (the broadcasts, the agreement, owner mode's gathers and scatters)
is completed through one `Collectives` object, and a failure to issue one is reported through it, so
that every failure becomes a `TransferFailedError` (an expired wait a `TransferTimeoutError`), alike on
every rank, and breaks the runtime where it happens (`Health`): the group may be out of step from then
on. ``what`` is a %-format of the collective's name, formatted only when something failed.

- `complete`: order the current stream after the work; on CPU the host waits too (`DeviceAPI.wait_work`).
- `complete_on_host`: block the host until the work completed (forward end, close, the agreement).
- `not_issued`: the error for a call that raised while starting a collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import TransferFailedError, TransferTimeoutError
from kvpp_fx.runtime.health import Health


class Collectives:
    """One runtime's completion of its collectives: its device API, its timeout, its health."""

    __slots__ = ("api", "timeout", "health")

    def __init__(self, api: DeviceAPI, timeout: timedelta, health: Health) -> None:
        self.api = api
        self.timeout = timeout
        self.health = health

    def complete(self, work: Any, what: str, *args: Any) -> None:
        start = time.monotonic()
        try:
            self.api.wait_work(work, self.timeout)
        except Exception as exc:
            raise self._failed(exc, time.monotonic() - start, what % args) from exc

    def complete_on_host(self, work: Any, what: str, *args: Any) -> None:
        start = time.monotonic()
        try:
            self.api.host_wait_work(work, self.timeout)
        except Exception as exc:
            raise self._failed(exc, time.monotonic() - start, what % args) from exc

    def run(self, issue: Callable[[], Any], what: str, *args: Any) -> None:
        """Issue one collective (`issue` returns its work) and complete it: the device's order on a device,
        the host's wait on CPU."""
        try:
            work = issue()
        except Exception as exc:
            raise self.not_issued(exc, what, *args) from exc
        self.complete(work, what, *args)

    def not_issued(self, exc: Exception, what: str, *args: Any) -> TransferFailedError:
        """``raise collectives.not_issued(exc, ...) from exc`` where starting a collective raised `exc`."""
        failure = TransferFailedError(f"{what % args} could not be issued: {exc}")
        self.health.broken_by(failure)
        return failure

    def _failed(self, exc: Exception, elapsed: float, what: str) -> TransferFailedError:
        timeout = self.timeout.total_seconds()
        if elapsed >= timeout * 0.99 or "timed out" in str(exc).lower():
            failure: TransferFailedError = TransferTimeoutError(
                f"{what} did not complete within {timeout:g}s (a peer died or stopped issuing collectives): {exc}")
        else:
            failure = TransferFailedError(f"{what} failed: {exc}")
        self.health.broken_by(failure)
        return failure
