"""One vLLM step's requests as KVPP reads them, whichever model runner scheduled it.

A `StepBatch` holds host arrays only, in the batch order the runner gives its attention metadata:
the scheduled requests' computed-token counts, query lengths and prompt lengths, and, per KV cache
group, the rows of the block table. The runners' adapters build it from their own objects (V1: the
input batch's block table; V2: a host mirror of its device block tables, `runner_v2.HostBlockTables`),
so nothing here reads a device tensor.

Invariants:
- Block ids that hold history are the first ``ceil(num_computed / block_size)`` entries of a row;
  those a step fills beyond them run up to ``ceil((num_computed + query) / block_size)``.
- Results are sorted and free of duplicates, so every rank of a group derives the same lists from
  the same scheduler output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockRows:
    """One KV cache group's block-table rows of the step's requests: ``rows[i]`` is request i's."""

    block_size: int
    rows: np.ndarray  # [num_reqs, width]


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
            if table.rows.ndim != 2 or table.rows.shape[0] < computed.shape[0]:
                raise ValueError(f"a block table of shape {table.rows.shape} holds no row for each of "
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


def request_blocks(batch: StepBatch) -> tuple[list[list[int]], list[list[int]]]:
    """Per request: the ids of its blocks that hold history, and of the blocks the step fills beyond
    them, over every cache group."""
    n = batch.num_reqs
    history: list[set[int]] = [set() for _ in range(n)]
    written: list[set[int]] = [set() for _ in range(n)]
    ends = batch.num_computed + batch.query_lens
    for table in batch.tables:
        rows = np.asarray(table.rows[:n])
        counts = -(-batch.num_computed // table.block_size)
        lasts = -(-ends // table.block_size)
        for i in range(n):
            history[i].update(rows[i, : counts[i]].tolist())
            written[i].update(rows[i, counts[i]: lasts[i]].tolist())
    return [sorted(ids) for ids in history], [sorted(ids - history[i]) for i, ids in enumerate(written)]


def active_blocks(batch: StepBatch) -> list[int]:
    """Block ids the step reads that hold tokens computed before it (prefix-cache hits included)."""
    return _union(batch, batch.num_computed * 0, batch.num_computed)


def written_blocks(batch: StepBatch) -> list[int]:
    """Block ids the step writes beyond each request's history (a block holding history is not one)."""
    return _union(batch, batch.num_computed, batch.num_computed + batch.query_lens)


def _union(batch: StepBatch, first_token: np.ndarray, end_token: np.ndarray) -> list[int]:
    ids = []
    for table in batch.tables:
        rows = np.asarray(table.rows[: batch.num_reqs])
        columns = np.arange(rows.shape[1])[None, :]
        first = -(-first_token // table.block_size)
        last = -(-end_token // table.block_size)
        ids.append(rows[(columns >= first[:, None]) & (columns < last[:, None])])
    return np.unique(np.concatenate(ids)).tolist() if ids else []
