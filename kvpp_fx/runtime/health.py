"""Whether a runtime can still be trusted, and the first failure that says it cannot.

Invariant: once broken, a runtime stays broken, and every later forward (and any op still running in
the failing one) raises `RuntimeBrokenError` naming the first cause. Completing the collectives that
were issued proves nothing: a rank that aborted earlier than its peer can see its pending collective
pair with the peer's next one, which then "completes" with another layer's bytes. Recovery is a new
process group and a new runtime.

What breaks it: a collective that fails or times out (`Collectives`, where the failure happens), and,
in `Forward`, a forward that raised or broke the protocol after issuing any collective, an owner that
reported a failure, and block ids that arrived from another forward.
"""

from __future__ import annotations

import logging

from kvpp_fx.runtime.errors import RuntimeBrokenError

logger = logging.getLogger(__name__)


class Health:
    """The broken state of one runtime and its first cause."""

    __slots__ = ("rank", "cause")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.cause: BaseException | None = None

    def broken_by(self, cause: BaseException) -> BaseException:
        """Break the runtime (the first cause is kept); returns `cause`, so ``raise health.broken_by(e)``."""
        if self.cause is None:
            self.cause = cause
            logger.error("KVPP runtime on rank %d is broken: %s: %s", self.rank, type(cause).__name__, cause)
        return cause

    def check(self) -> None:
        """Raise `RuntimeBrokenError`, chained to the first cause, once the runtime is broken."""
        cause = self.cause
        if cause is not None:
            raise RuntimeBrokenError(
                f"this KVPPRuntime is broken since {type(cause).__name__}: {cause}. The group's broadcast "
                "sequence can no longer be trusted; create a new process group and a new KVPPRuntime."
            ) from cause

    def describe(self) -> str | None:
        """The first cause as ``"Error: message"``, or None while the runtime is usable."""
        return None if self.cause is None else f"{type(self.cause).__name__}: {self.cause}"
