"""Bounded transfer statistics: totals, per-layer totals and the last forward only.

Memory and the cost of `snapshot` are O(layers), whatever the number of forwards served. Layers are
counted by their position in the plan's order, as the runtime's ops know them.
"""

from __future__ import annotations

from typing import Any


class ForwardRecord:
    """What one forward moved."""

    __slots__ = ("has_history", "mode", "broadcasts", "layers", "exchanges", "choice", "rows", "broadcast_bytes",
                 "exchange_bytes", "context_chunks", "context_bytes")

    def __init__(self, has_history: bool, mode: str = "broadcast", choice: dict[str, Any] | None = None,
                 rows: dict[str, int] | None = None) -> None:
        self.has_history = has_history
        self.mode = mode  # broadcast, owner, or hybrid (owner rows and broadcast rows in one forward)
        self.broadcasts = 0
        self.broadcast_bytes = 0
        self.exchange_bytes = 0
        self.layers: list[int] = []  # broadcast layers, in completion order
        self.exchanges = 0  # owner-mode query/output exchanges
        self.context_chunks = 0  # prefill history chunks streamed from their owners
        self.context_bytes = 0
        self.choice = choice  # the "auto" cost comparison, when the mode was chosen
        self.rows = rows  # query tokens by path, when the forward named its requests

    @property
    def bytes(self) -> int:
        return self.broadcast_bytes + self.exchange_bytes + self.context_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"has_history": self.has_history, "mode": self.mode, "broadcasts": self.broadcasts,
                "bytes": self.bytes, "broadcast_bytes": self.broadcast_bytes, "exchange_bytes": self.exchange_bytes,
                "context_chunks": self.context_chunks, "context_bytes": self.context_bytes,
                "layers": list(self.layers), "exchanges": self.exchanges, "choice": self.choice, "rows": self.rows}


class TransferStats:
    def __init__(self, layers: tuple[int, ...]) -> None:
        self._layers = layers
        self._broadcasts = [0] * len(layers)
        self._bytes = [0] * len(layers)
        self._exchanges = [0] * len(layers)
        self._context_chunks = [0] * len(layers)
        self.context_bytes = 0
        self.context_ahead = 0  # of the chunks, those found in flight by their call (issued ahead)
        self.forwards = 0
        self.modes = {"broadcast": 0, "owner": 0, "hybrid": 0}
        self.rows = {"broadcast": 0, "owner": 0}  # query tokens by path, over forwards that named requests
        self.current: ForwardRecord | None = None
        self.last: ForwardRecord | None = None

    def begin_forward(self, has_history: bool, mode: str = "broadcast", choice: dict[str, Any] | None = None,
                      rows: dict[str, int] | None = None) -> None:
        self.current = ForwardRecord(has_history, mode, choice, rows)

    def end_forward(self) -> None:
        current = self.current
        if current is not None:
            self.forwards += 1
            self.modes[current.mode] += 1
            for path, tokens in (current.rows or {}).items():
                self.rows[path] += tokens
            self.last, self.current = current, None

    # the totals, summed over the layers when read: the per-layer counts are what each op updates
    @property
    def broadcasts(self) -> int:
        return sum(self._broadcasts)

    @property
    def bytes(self) -> int:
        return sum(self._bytes)

    @property
    def exchanges(self) -> int:
        return sum(self._exchanges)

    def record(self, position: int, nbytes: int) -> None:
        """One completed broadcast of the layer at `position`, `nbytes` over this rank's link."""
        self._broadcasts[position] += 1
        self._bytes[position] += nbytes
        current = self.current
        if current is not None:
            current.broadcasts += 1
            current.broadcast_bytes += nbytes
            current.layers.append(self._layers[position])

    def record_exchange(self, position: int, nbytes: int) -> None:
        """One owner-mode exchange (queries in, outputs out) of the layer at `position`."""
        self._bytes[position] += nbytes
        self._exchanges[position] += 1
        current = self.current
        if current is not None:
            current.exchange_bytes += nbytes
            current.exchanges += 1

    @property
    def context_chunks(self) -> int:
        return sum(self._context_chunks)

    def record_context(self, position: int, nbytes: int, ahead: bool = False) -> None:
        """One chunk of prefill history streamed from the owner of the layer at `position` (`ahead`: issued
        before its call came)."""
        self._bytes[position] += nbytes
        self._context_chunks[position] += 1
        self.context_bytes += nbytes
        self.context_ahead += ahead
        current = self.current
        if current is not None:
            current.context_bytes += nbytes
            current.context_chunks += 1

    def snapshot(self, **extra: Any) -> dict[str, Any]:
        """Everything above as one new dict, plus `extra` keys (the runtime's allocation and state)."""
        return {
            "forwards": self.forwards,
            "broadcasts": self.broadcasts,
            "bytes": self.bytes,
            "exchanges": self.exchanges,
            "context_chunks": self.context_chunks,
            "context_bytes": self.context_bytes,
            "context_ahead": self.context_ahead,
            "modes": dict(self.modes),
            "rows": dict(self.rows),
            "per_layer": {layer: {"broadcasts": self._broadcasts[k], "exchanges": self._exchanges[k],
                                  "context_chunks": self._context_chunks[k], "bytes": self._bytes[k]}
                          for k, layer in enumerate(self._layers)},
            "last_forward": self.last.as_dict() if self.last is not None else None,
            **extra,
        }
