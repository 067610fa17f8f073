"""The reference engine's request bookkeeping: what a request holds, which of its tokens a step
computes, and how the step's greedy results advance it.

Per step: running decodes first (one token, or two with an MTP draft), then a prefill chunk of the
oldest waiting prompt under the token budget. An admitted prompt reuses the cached full blocks of its
prefix (`BlockPool`). Sampling is greedy and MTP drafts are verified greedily, so speculative output
equals plain greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpp_fx.reference.block_pool import BlockPool


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    admitted: bool = False
    draft: int | None = None
    drafts_proposed: int = 0
    drafts_accepted: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens of one request that one step computes (a decode, or a chunk of a prefill)."""

    request: Request
    start: int          # first token position computed this step
    count: int          # tokens computed this step
    draft: int | None   # the draft token among them (last one), if any


def schedule(requests: list[Request], pool: BlockPool, token_budget: int) -> list[ScheduledChunk]:
    """The next step's chunks, in batch order: decodes first, then at most one prefill chunk."""
    budget = token_budget
    batch: list[ScheduledChunk] = []
    live = [r for r in requests if not r.finished]
    for request in (r for r in live if r.admitted and not r.prefilling):
        count = 2 if request.draft is not None else 1
        if count > budget:
            break
        batch.append(ScheduledChunk(request, request.num_computed, count, request.draft))
        budget -= count
    # One request prefills at a time, first come first served: a later prompt is admitted only once
    # the earlier ones are fully computed, so it can reuse their cached prefix blocks.
    waiting = next((r for r in live if not r.admitted or r.prefilling), None)
    if waiting is not None and budget > 0:
        if not waiting.admitted:
            admit(waiting, pool)
        count = min(len(waiting.prompt) - waiting.num_computed, budget)
        batch.append(ScheduledChunk(waiting, waiting.num_computed, count, None))
    return batch


def admit(request: Request, pool: BlockPool) -> None:
    block_size = pool.block_size
    hit = pool.match_prefix(request.prompt)
    # keep at least one prompt token to compute, so the step yields logits for it
    usable = min(len(hit), (len(request.prompt) - 1) // block_size)
    for block in hit[:usable]:
        pool.take(block)
    request.blocks = list(hit[:usable])
    request.num_computed = request.cached_tokens = usable * block_size
    request.admitted = True


def ensure_blocks(request: Request, upto: int, pool: BlockPool) -> None:
    """Allocate blocks until the request's cover its first ``upto`` tokens."""
    needed = -(-upto // pool.block_size)
    while len(request.blocks) < needed:
        request.blocks.append(pool.allocate())


def accept(batch: list[ScheduledChunk], sampled: list[int], pool: BlockPool) -> list[tuple[int, int]]:
    """Apply greedy results; return each request's accepted (start, count) positions."""
    spans, cursor = [], 0
    for item in batch:
        request = item.request
        if item.draft is not None:
            first, bonus = sampled[cursor], sampled[cursor + 1]
            cursor += 2
            request.drafts_proposed += 1
            if first == item.draft:
                request.drafts_accepted += 1
                request.output += [first, bonus]
                accepted = 2
            else:
                request.output.append(first)
                accepted = 1
        else:
            token = sampled[cursor]
            cursor += 1
            accepted = item.count
            if item.start + item.count >= len(request.prompt):
                request.output.append(token)
        request.draft = None
        request.num_computed = item.start + accepted
        del request.output[request.max_new_tokens:]
        spans.append((item.start, accepted))
        _register_blocks(request, pool)
        if request.finished:
            pool.release(request.blocks)
    return spans


def _register_blocks(request: Request, pool: BlockPool) -> None:
    tokens = request.tokens[: request.num_computed]
    for i, h in enumerate(BlockPool.chain_hashes(tokens, pool.block_size)):
        pool.register(request.blocks[i], h)
