"""Whether a step may gather a layer's first history chunk before it writes that layer's cache
(`batch.history_written_by_step`, read by `step.history_ahead`): not when a request's history ends on a
block that another request of the step fills (vLLM's same-step prefix hit), whichever row writes it."""

from __future__ import annotations

import numpy as np
import pytest

from kvpp_fx.integrations.vllm.engine.batch import BlockRows, StepBatch, history_written_by_step

BLOCK = 16


def batch(computed: list[int], query: list[int], rows: list[list[int]]) -> StepBatch:
    table = np.array([row + [0] * (6 - len(row)) for row in rows], dtype=np.int64)
    return StepBatch.of(computed, query, [c + q for c, q in zip(computed, query)], (BlockRows(BLOCK, table),))


CASES = {
    # request 0 fills blocks 7, 8, 9 in this step; request 1 was scheduled after it and hit 7 and 8
    "a same-step prefix hit": (([0, 32], [40, 8], [[7, 8, 9], [7, 8, 11]]), 0, True),
    # the same hit on blocks computed in an earlier step: nothing of the history is written now
    "a hit on earlier blocks": (([0, 32], [40, 8], [[5, 6, 9], [7, 8, 11]]), 0, False),
    # a later chunk of one prompt: its history ends inside block 4, which only it fills further
    "its own partial last block": (([20], [30], [[3, 4, 5, 6]]), 0, False),
    # request 0 completes its partial block 8 in this step, and request 1 hits it
    "a hit on a block completed in the step": (([20, 32], [12, 8], [[7, 8], [7, 8, 11]]), 0, True),
    # a decode row (before `first`) completes block 8, and a prefill row hits it
    "a decode row completes the block hit": (([31, 32], [1, 8], [[7, 8], [7, 8, 11]]), 1, True),
    # a hit chain of request 0's block 7, written now, then an older copy (20) of the block after it
    "a hit chain that mixes a written block with older ones": (([0, 32], [40, 8], [[7, 8, 9], [7, 20, 11]]), 0, True),
    # only decode rows: no prefill row's history streams
    "no prefill row with history": (([31, 0], [1, 8], [[7, 8], [12]]), 1, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_history_written_by_the_step(case):
    (computed, query, rows), first, written = CASES[case]
    assert history_written_by_step(batch(computed, query, rows), first) is written
