"""One vLLM step's requests as KVPP reads them, whichever model runner scheduled it.

A `StepBatch` holds host arrays only, in the batch order the runner gives its attention metadata:
the scheduled requests' computed-token counts, query lengths and prompt lengths, and, per KV cache
group, the rows of the block table. The runners' adapters build it from their own objects (V1: the
input batch's block table; V2: a host mirror of its device block tables, `runner_v2.HostBlockTables`),
so nothing here reads a device tensor.

Invariants:
- Block ids that hold history are the first ``ceil(num_computed / block_size)`` entries of a row;
  those a step fills beyond them run up to ``ceil((num_computed + query) / block_size)``.
- Results are `BlockIds`: sorted and free of duplicates, so every rank of a group derives the same
  lists from the same scheduler output; built on first read, with numpy over the rows (a step's host
  work grows with its requests, and with their history only where a broadcast needs the ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpp_fx.cache.block_ids import BlockIds, difference


@dataclass(frozen=True)
class BlockRows:
    """One KV cache group's block-table rows of the step's requests: request i's is ``table[order[i]]``
    (``order`` None: ``table[i]``). A runner whose table is not in batch order (V2's, by request slot)
    hands its whole table and the batch's order, and only the rows a step reads are gathered."""

    block_size: int
    table: np.ndarray  # [rows, width]
    order: np.ndarray | None = None  # [num_reqs]: each request's row of `table`

    @property
    def num_rows(self) -> int:
        return int(self.table.shape[0] if self.order is None else self.order.shape[0])

    @property
    def rows(self) -> np.ndarray:
        """Every request's row, in batch order (a copy where `order` is given)."""
        return self.rows_of(0, self.num_rows)

    def rows_of(self, first: int, end: int) -> np.ndarray:
        """Requests ``first..end-1``'s rows."""
        if self.order is None:
            return np.asarray(self.table[first:end])
        return self.table[self.order[first:end]]


@dataclass(frozen=True)
class StepBatch:
    """The step's scheduled requests, in batch order."""

    num_computed: np.ndarray  # [num_reqs] tokens computed before the step
    query_lens: np.ndarray  # [num_reqs] tokens the step computes
    num_prompt: np.ndarray  # [num_reqs] prompt tokens (stats only)
    tables: tuple[BlockRows, ...]  # one per KV cache group

    @classmethod
    def of(cls, num_computed: Sequence[int], query_lens: Sequence[int], num_prompt: Sequence[int],
           tables: Sequence[BlockRows]) -> StepBatch:
        computed = np.asarray(num_computed, dtype=np.int64)
        query = np.asarray(query_lens, dtype=np.int64)
        prompt = np.asarray(num_prompt, dtype=np.int64)
        if not (computed.shape == query.shape == prompt.shape) or computed.ndim != 1:
            raise ValueError(f"a step batch needs one count per request, got {computed.shape}, {query.shape}, "
                             f"{prompt.shape}.")
        for table in tables:
            if table.table.ndim != 2 or table.num_rows < computed.shape[0]:
                raise ValueError(f"a block table of shape {table.table.shape} holds no row for each of "
                                 f"{computed.shape[0]} requests.")
        return cls(computed, query, prompt, tuple(tables))

    @property
    def num_reqs(self) -> int:
        return int(self.num_computed.shape[0])

    @property
    def has_history(self) -> bool:
        """Whether any request reads tokens computed before the step (the seed's rule)."""
        return bool((self.num_computed > 0).any())

    @property
    def prefill_rows_with_history(self) -> int:
        """Rows whose prompt resumes after computed tokens: a later chunk, or a prefix-cache hit."""
        return int(((self.num_computed > 0) & (self.num_computed < self.num_prompt)).sum())


def history_blocks(batch: StepBatch, first: int = 0, end: int | None = None) -> BlockIds:
    """The blocks holding history that requests ``first..end-1`` read, over every cache group: built
    on first read, in numpy (no per-id Python), so a path that never reads it costs nothing."""
    return BlockIds.lazy(lambda: _entries(batch, first, end, written=False))


def written_blocks(batch: StepBatch, first: int = 0, end: int | None = None) -> BlockIds:
    """The blocks requests ``first..end-1`` fill beyond their history, less every block holding history
    that they read (a block holding history is not a written one); built on first read."""
    history = history_blocks(batch, first, end)
    return BlockIds.lazy(lambda: difference(BlockIds.of(_entries(batch, first, end, written=True)), history).array)


def active_blocks(batch: StepBatch) -> BlockIds:
    """Block ids the step reads that hold tokens computed before it (prefix-cache hits included)."""
    return history_blocks(batch)


def _entries(batch: StepBatch, first: int, end: int | None, written: bool) -> np.ndarray:
    """The block-table entries of requests ``first..end-1`` that hold history (or, `written`, those the
    step fills beyond it), concatenated over the cache groups, duplicates kept."""
    end = batch.num_reqs if end is None else end
    computed = batch.num_computed[first:end]
    parts = []
    for table in batch.tables:
        rows = table.rows_of(first, end)
        counts = -(-computed // table.block_size)
        columns = np.arange(rows.shape[1])[None, :]
        if written:
            lasts = -(-(computed + batch.query_lens[first:end]) // table.block_size)
            parts.append(rows[(columns >= counts[:, None]) & (columns < lasts[:, None])])
        else:
            parts.append(rows[columns < counts[:, None]])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def history_written_by_step(batch: StepBatch, first: int = 0) -> bool:
    """Whether a history block of a request ``first..`` is one that a request of the step writes: vLLM
    caches a block's hash when it schedules the block's tokens, so a request scheduled later in the same
    step may hit blocks that this step fills (a hit chain may also mix such a block with older copies of
    the blocks after it). A request's own partial last history block, which it fills further, does not
    count. Host arrays: the history entries of the requests ``first..`` (prefill rows, whose attention
    reads that history anyway) against the entries the step writes."""
    end = batch.num_reqs
    computed, query = batch.num_computed, batch.query_lens
    if not (computed[first:] > 0).any():
        return False
    for table in batch.tables:
        size, rows = table.block_size, table.rows_of(0, end)
        columns = np.arange(rows.shape[1])[None, :]
        fills = (columns >= (computed // size)[:, None]) & (columns < (-(-(computed + query) // size))[:, None])
        written = np.sort(rows[fills])
        reads = columns < (-(-computed[first:] // size))[:, None]
        history = rows[first:][reads]
        writers = np.searchsorted(written, history, side="right") - np.searchsorted(written, history, side="left")
        own = (fills[first:] & reads)[reads]  # the request's own write into its partial last block
        if (writers > own).any():
            return True
    return False
