"""Sets of block ids as int64 arrays, and their unions, in time that grows with the ids, never per id in Python.

A step's block sets are big on the contexts KVPP exists for (256 requests of 2,000 blocks each hold half
a million ids), and the host builds them on every step. So a set is a sorted int64 array without
duplicates (`BlockIds`), built on first read where a path may never need it (a decode group that goes
to the owner is never unioned), and unions mark a bitmap over the pool instead of sorting
(``np.unique`` of half a million ids takes some 200 ms on a 2-core host; the bitmap about 1 ms).

Invariant: `BlockIds.array` is sorted, free of duplicates and of dtype int64; equal sets give equal
arrays, so every rank that builds a set from the same scheduler output holds the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def sorted_unique(ids: np.ndarray) -> np.ndarray:
    """`ids` (any order, duplicates allowed, all >= 0) as a sorted int64 array without duplicates."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size <= 1:
        return ids.copy()
    high = int(ids.max())
    if ids.min() < 0 or high > 16 * ids.size + (1 << 16):  # sparse or negative ids: the bitmap would not pay
        return np.unique(ids)
    mask = np.zeros(high + 1, dtype=bool)
    mask[ids] = True
    return np.flatnonzero(mask).astype(np.int64, copy=False)


class BlockIds:
    """A sorted set of block ids, held as an int64 array; `BlockIds.lazy` builds it on first read.

    It reads as a sequence of ints (``len``, iteration, indexing, equality with any sequence), so a
    caller that passes a tuple and one that passes a `BlockIds` see the same behaviour."""

    __slots__ = ("_array", "_build")

    def __init__(self, array: np.ndarray | None = None, build: Callable[[], np.ndarray] | None = None) -> None:
        self._array = array
        self._build = build

    @classmethod
    def of(cls, ids: Any) -> BlockIds:
        """A set of the given ids (any iterable of ints, an array, or a `BlockIds`)."""
        if isinstance(ids, BlockIds):
            return ids
        if isinstance(ids, np.ndarray):
            if ids.dtype.kind not in "iu":
                raise ValueError(f"block ids must be integers, got an array of {ids.dtype}.")
            if ids.size and ids.min() < 0:
                raise ValueError(f"block ids are never negative, got {int(ids.min())}.")
            return cls(sorted_unique(ids))
        values = list(ids)
        if not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in values):
            raise ValueError(f"block ids must be ints, got {values!r}.")
        if any(b < 0 for b in values):
            raise ValueError(f"block ids are never negative, got {min(values)}.")
        return cls(np.unique(np.asarray(values, dtype=np.int64)) if values else _EMPTY)

    @classmethod
    def lazy(cls, build: Callable[[], np.ndarray]) -> BlockIds:
        """The set of the ids `build` returns (any order, duplicates allowed), built on first read."""
        return cls(None, build)

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = sorted_unique(self._build())
            self._build = None
        return self._array

    def __len__(self) -> int:
        return int(self.array.size)

    def __bool__(self) -> bool:
        return self.array.size > 0

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def __getitem__(self, index: int) -> int:
        return int(self.array[index])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockIds):
            return np.array_equal(self.array, other.array)
        if isinstance(other, (tuple, list)):
            return len(other) == self.array.size and self.array.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.array.tolist()))  # equal to the hash of the equal tuple

    def __repr__(self) -> str:
        ids = self.array
        shown = ids.tolist() if ids.size <= 8 else [*ids[:4].tolist(), "...", *ids[-2:].tolist()]
        return f"BlockIds({shown}, n={ids.size})"


EMPTY = BlockIds(_EMPTY)


def union(sets: Iterable[BlockIds]) -> BlockIds:
    """The union of `sets`."""
    arrays = [s.array for s in sets]
    arrays = [a for a in arrays if a.size]
    if not arrays:
        return EMPTY
    if len(arrays) == 1:
        return BlockIds(arrays[0])
    return BlockIds(sorted_unique(np.concatenate(arrays)))


def difference(ids: BlockIds, minus: BlockIds) -> BlockIds:
    """The ids of `ids` that are not in `minus`."""
    if not ids or not minus:
        return ids
    a, b = ids.array, minus.array
    high = int(max(a[-1], b[-1]))
    if high > 16 * (a.size + b.size) + (1 << 16):  # sparse ids: the bitmap would not pay
        return BlockIds(np.setdiff1d(a, b, assume_unique=True))
    mask = np.zeros(high + 1, dtype=bool)
    mask[b] = True
    return BlockIds(a[~mask[a]])
