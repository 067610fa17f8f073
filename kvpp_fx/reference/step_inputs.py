"""The host tensors one step feeds the reference model: the target forward's (`target_inputs`) and the
MTP draft layer's (`draft_inputs`), built from the scheduled chunks in batch order (row i of a block
table is chunk i's request). Every chunk's blocks must already be allocated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpp_fx.reference.scheduling import ScheduledChunk


def cache_slot(blocks: list[int], position: int, block_size: int) -> int:
    """The flat cache slot that holds token ``position`` of a request with these blocks."""
    return blocks[position // block_size] * block_size + position % block_size


def block_table(rows: list[list[int]], width: int) -> torch.Tensor:
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for row, blocks in enumerate(rows):
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return table


def target_inputs(batch: list[ScheduledChunk], block_size: int, width: int) -> dict[str, torch.Tensor]:
    """The target model's step inputs; a chunk with a draft yields logits for each of its tokens (to
    verify the draft), any other for its last token only."""
    ids, positions, slots, logits_at = [], [], [], []
    for item in batch:
        request = item.request
        tokens = request.tokens + ([item.draft] if item.draft is not None else [])
        for pos in range(item.start, item.start + item.count):
            ids.append(tokens[pos])
            positions.append(pos)
            slots.append(cache_slot(request.blocks, pos, block_size))
        first = len(ids) - item.count
        logits_at.extend(range(first, len(ids)) if item.draft is not None else [len(ids) - 1])
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "positions": torch.tensor(positions, dtype=torch.long),
        "slot_mapping": torch.tensor(slots, dtype=torch.long),
        "block_table": block_table([item.request.blocks for item in batch], width),
        "seq_lens": torch.tensor([i.start + i.count for i in batch], dtype=torch.long),
        "query_lens": torch.tensor([i.count for i in batch], dtype=torch.long),
        "logits_indices": torch.tensor(logits_at, dtype=torch.long),
    }


@dataclass(frozen=True)
class DraftInputs:
    """The MTP layer's inputs: position p takes token p + 1 and the target's hidden state at p."""

    rows: tuple[tuple[ScheduledChunk, list[int]], ...]  # each chunk that drafts, with its positions
    input_ids: torch.Tensor
    hidden_rows: torch.Tensor  # rows of the target's hidden states, one per position
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    logits_indices: torch.Tensor


def draft_inputs(batch: list[ScheduledChunk], spans: list[tuple[int, int]], block_size: int,
                 width: int) -> DraftInputs | None:
    """The draft layer's inputs over each unfinished request's newly accepted positions (those whose
    next token is known); None when no position qualifies."""
    rows, ids, positions, slots, hidden_rows, logits_at = [], [], [], [], [], []
    offset = 0
    for item, (start, accepted) in zip(batch, spans):
        request = item.request
        tokens = request.tokens
        take = [p for p in range(start, start + accepted) if p + 1 < len(tokens)]
        if take and not request.finished:
            rows.append((item, take))
            for p in take:
                ids.append(tokens[p + 1])
                positions.append(p)
                slots.append(cache_slot(request.blocks, p, block_size))
                hidden_rows.append(offset + (p - item.start))
            logits_at.append(len(ids) - 1)
        offset += item.count
    if not rows:
        return None
    return DraftInputs(
        rows=tuple(rows), input_ids=torch.tensor(ids), hidden_rows=torch.tensor(hidden_rows),
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        block_table=block_table([item.request.blocks for item, _ in rows], width),
        seq_lens=torch.tensor([take[-1] + 1 for _, take in rows]),
        query_lens=torch.tensor([len(take) for _, take in rows]), logits_indices=torch.tensor(logits_at))
