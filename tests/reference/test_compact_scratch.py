"""Compact scratch through the reference engine on real ranks: slots far narrower than the pool, steps
whose broadcast rows do not fit sending rows to their owners, and requests a slot cannot hold refused
when they are added.

Every token is compared against greedy decoding by full recomputation; the negative controls shift or
drop the remap of the packed slot through the device API, and the tokens change.
"""

import functools
import re

import pytest

from kvpp_fx.launch import RankFailure
from kvpp_fx.reference.config import PRESETS
from kvpp_fx.reference.engine import EngineConfig, RequestTooLongError, build_engine
from kvpp_fx.reference.generate import rank_groups, run_generation
from kvpp_fx.reference.weights import build_model
from tests.reference.helpers import recompute_greedy, shared_prefix_prompts
from tests.support.launch import launch

pytestmark = pytest.mark.multirank

NEW_TOKENS = 12
POOL = 64
# Each prompt of the workload (60 and 55 tokens, 48 of them a shared prefix) needs 5 blocks with its 12
# new tokens; together they touch 7. A 5-block slot holds either, never both: every step that runs
# both sends one of them to the owners.
SLOT = 5


@functools.lru_cache(maxsize=None)
def expected(preset, prompts):
    model = build_model(PRESETS[preset])
    return [recompute_greedy(model, list(p), NEW_TOKENS) for p in prompts]


def run(device_api=None):
    prompts = shared_prefix_prompts(PRESETS["tiny"].vocab_size)
    options = {"kvpp": True, "graph_mode": "eager", "token_budget": 24, "num_blocks": POOL, "scratch_blocks": SLOT,
               "device_api": device_api}
    return prompts, launch(run_generation, 2, "tiny", prompts, NEW_TOKENS, options, timeout_s=240)


def test_steps_wider_than_the_slot_send_rows_to_their_owners_and_match_recomputation():
    prompts, results = run()
    truth = expected("tiny", tuple(tuple(p) for p in prompts))
    for res in results:
        assert res["outputs"] == truth
        assert res["slot_blocks"] == SLOT and res["num_blocks"] == POOL
        steps = res["steps"]
        # once both requests decode they touch 7 blocks: one of them goes to the owners, the other is
        # broadcast; a step of one request always fits
        hybrid = [s for s in steps if s["mode"] == "hybrid"]
        assert len(hybrid) >= NEW_TOKENS // 2 and all(len(s["requests"]) == 2 for s in hybrid)
        assert all(sorted(s["paths"]) == ["broadcast", "owner"] for s in hybrid)
        assert all(s["mode"] == "broadcast" for s in steps if len(s["requests"]) == 1)


@pytest.mark.parametrize("fault", ["OffByOneRemap", "UnremappedTables"])
def test_negative_control_a_wrong_remap_changes_the_tokens_or_fails(fault):
    """A receiver reading its packed slot one position off, or through the pool's ids: its attention
    reads other blocks' bytes (the tokens change), or an index the slot does not hold (the reference op
    raises)."""
    try:
        prompts, results = run(device_api=f"tests.support.faults:{fault}")
    except RankFailure as exc:
        # an index of the slot's 5 blocks, or of its 5 x 16 token slots, that it does not hold
        assert re.search(r"is out of bounds for dimension 0 with size (5|80)\b", str(exc)), str(exc)[-2000:]
        return
    assert results[0]["outputs"] != expected("tiny", tuple(tuple(p) for p in prompts))


def admission_ranks(rank: int, world: int) -> str | None:
    groups = rank_groups(rank, world, 1)
    engine = build_engine(PRESETS["tiny"], engine_config=EngineConfig(scratch_blocks=SLOT), num_blocks=POOL, kvpp=True,
                          tp=groups.tp, kvpp_group=groups.kvpp_group, pp=groups.pp, link=groups.link)
    try:
        engine.add_request([1] * 60, 19)  # 80 tokens: 5 blocks, the slot's size
        try:
            engine.add_request([1] * 60, 20)
        except RequestTooLongError as exc:
            return str(exc)
        return None
    finally:
        engine.runtime.close()


def test_a_request_longer_than_a_slot_holds_is_refused_when_added():
    for message in launch(admission_ranks, 2, timeout_s=120):
        assert message == ("prompt (60) + 20 new tokens need 6 blocks of 16 tokens; a scratch slot holds 5 "
                           "(scratch_blocks), so at most 79 tokens per request.")
