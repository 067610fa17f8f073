"""Which runtime's forward is open on this thread: the one the kvpp ops and routed ops serve."""

from __future__ import annotations

import contextvars
from typing import Any

from kvpp_fx.runtime.errors import NoActiveForwardError

CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("kvpp_runtime", default=None)


def active_runtime() -> Any:
    """The `KVPPRuntime` of the enclosing ``runtime.forward(...)``, or None outside one."""
    return CURRENT.get()


def current_runtime() -> Any:
    runtime = CURRENT.get()
    if runtime is None:
        raise NoActiveForwardError(
            "kvpp.prefetch/kvpp.wait ran outside `with runtime.forward(has_history):`.")
    return runtime
