"""Deliberate faults, entering the library only through its seams (a `DeviceAPI` or a transport).

Each is the negative control of an equality test: with it the outputs must differ.
"""

from __future__ import annotations

from kvpp_fx.runtime.device import DeviceAPI


class SkippedScatter(DeviceAPI):
    """Receivers of an active-block broadcast leave the received blocks in staging: their scratch slot
    keeps stale bytes, while the ids that arrived still match (so no check catches it)."""

    def scatter_blocks(self, dest, ids, source) -> None:
        return None
