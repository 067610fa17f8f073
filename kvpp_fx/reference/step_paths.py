"""What the reference engine tells its runtime about a step, so that the runtime can pick each
request's path (broadcast or owner; a hybrid step has both): the blocks with history the step reads,
the blocks it fills, its load for the cost model, and each request's rows.

Pure functions of the scheduled chunks: a request's blocks with history are the first
``ceil(start / block_size)`` of its block table, those the step fills run up to
``ceil((start + count) / block_size)``.
"""

from __future__ import annotations

from kvpp_fx.cache.cost import RequestRows, StepLoad, scored_pairs
from kvpp_fx.reference.scheduling import ScheduledChunk


def blocks_with_history(item: ScheduledChunk, block_size: int) -> list[int]:
    return item.request.blocks[: -(-item.start // block_size)]


def blocks_filled(item: ScheduledChunk, block_size: int) -> list[int]:
    return item.request.blocks[-(-item.start // block_size): -(-(item.start + item.count) // block_size)]


def active_blocks(batch: list[ScheduledChunk], block_size: int) -> list[int]:
    """The blocks this step reads that hold tokens computed before it: for every scheduled request,
    the block-table entries covering its computed tokens (prefix-cache hits included)."""
    blocks: set[int] = set()
    for item in batch:
        blocks.update(blocks_with_history(item, block_size))
    return sorted(blocks)


def written_blocks(batch: list[ScheduledChunk], block_size: int) -> list[int]:
    """The blocks this step writes that hold no token computed before it."""
    return sorted({b for item in batch for b in blocks_filled(item, block_size)})


def step_load(batch: list[ScheduledChunk], index_topk: int | None) -> StepLoad:
    """The step's query tokens and the (query, context token) pairs its attention scores."""
    return StepLoad(sum(item.count for item in batch),
                    sum(scored_pairs(item.count, item.start, index_topk) for item in batch))


def request_rows(batch: list[ScheduledChunk], block_size: int, index_topk: int | None) -> tuple[RequestRows, ...]:
    """Each scheduled request's rows, the blocks with history it reads and the blocks it fills, in
    batch order (the order of the rows of the step's block table): the runtime gives each its path."""
    return tuple(RequestRows(item.count, scored_pairs(item.count, item.start, index_topk),
                             tuple(blocks_with_history(item, block_size)),
                             written=tuple(blocks_filled(item, block_size)))
                 for item in batch)
