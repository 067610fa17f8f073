"""The end-to-end workload, scaled down from the reference project's own end-to-end test."""

from __future__ import annotations

import torch

NEW_TOKENS = 16
TOKEN_BUDGET = 32


def shared_prefix_prompts(vocab: int, prefix_blocks: int = 3, block_size: int = 16,
                          seed: int = 7) -> list[list[int]]:
    """Two prompts sharing a multi-block prefix. At a 32-token budget the first needs two prefill
    chunks, and the second, admitted after it, hits the prefix cache."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (prefix_blocks * block_size,), generator=gen).tolist()
    first = prefix + torch.randint(0, vocab, (12,), generator=gen).tolist()
    second = prefix + torch.randint(0, vocab, (7,), generator=gen).tolist()
    return [first, second]
