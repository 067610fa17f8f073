"""Bounded transfer statistics: totals, per-layer totals and the last forward only.

Memory and the cost of `snapshot` are O(layers), whatever the number of forwards served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForwardRecord:
    has_history: bool
    mode: str = "broadcast"
    broadcasts: int = 0
    bytes: int = 0
    layers: list[int] = field(default_factory=list)  # broadcast layers, in completion order
    exchanges: int = 0  # owner-mode query/output exchanges
    choice: dict[str, Any] | None = None  # the "auto" cost comparison, when the mode was chosen

    def as_dict(self) -> dict[str, Any]:
        return {"has_history": self.has_history, "mode": self.mode, "broadcasts": self.broadcasts,
                "bytes": self.bytes, "layers": list(self.layers), "exchanges": self.exchanges,
                "choice": self.choice}


class TransferStats:
    def __init__(self, layers: tuple[int, ...]) -> None:
        self._layers = layers
        self._position = {layer: k for k, layer in enumerate(layers)}
        self._broadcasts = [0] * len(layers)
        self._bytes = [0] * len(layers)
        self._exchanges = [0] * len(layers)
        self.forwards = 0
        self.broadcasts = 0
        self.bytes = 0
        self.exchanges = 0
        self.modes = {"broadcast": 0, "owner": 0}
        self.current: ForwardRecord | None = None
        self.last: ForwardRecord | None = None

    def begin_forward(self, has_history: bool, mode: str = "broadcast",
                      choice: dict[str, Any] | None = None) -> None:
        self.current = ForwardRecord(has_history, mode, choice=choice)

    def end_forward(self) -> None:
        if self.current is not None:
            self.forwards += 1
            self.modes[self.current.mode] += 1
            self.last, self.current = self.current, None

    def record_exchange(self, layer: int, nbytes: int) -> None:
        """One owner-mode exchange (queries in, outputs out) of `layer`, `nbytes` over this rank's link."""
        k = self._position[layer]
        self._bytes[k] += nbytes
        self._exchanges[k] += 1
        self.bytes += nbytes
        self.exchanges += 1
        if self.current is not None:
            self.current.bytes += nbytes
            self.current.exchanges += 1

    def record(self, layer: int, nbytes: int) -> None:
        k = self._position[layer]
        self._broadcasts[k] += 1
        self._bytes[k] += nbytes
        self.broadcasts += 1
        self.bytes += nbytes
        if self.current is not None:
            self.current.broadcasts += 1
            self.current.bytes += nbytes
            self.current.layers.append(layer)

    def snapshot(self) -> dict[str, Any]:
        return {
            "forwards": self.forwards,
            "broadcasts": self.broadcasts,
            "bytes": self.bytes,
            "exchanges": self.exchanges,
            "modes": dict(self.modes),
            "per_layer": {layer: {"broadcasts": self._broadcasts[k], "exchanges": self._exchanges[k],
                                  "bytes": self._bytes[k]} for k, layer in enumerate(self._layers)},
            "last_forward": self.last.as_dict() if self.last is not None else None,
        }
