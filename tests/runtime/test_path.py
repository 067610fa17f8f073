"""`choose_path` alone: a step and what the runtime knows in, the forward's path out (no ranks, no tensors)."""

import dataclasses
import os
from pathlib import Path

import pytest

from kvpp_fx.cache.cost import AUTO, BROADCAST, HYBRID, OWNER, AttentionShape, LinkModel, RequestRows, StepLoad
from kvpp_fx.runtime.errors import InvalidBlocksError, OwnerModeUnsupportedError
from kvpp_fx.runtime.path import PathFacts, ForwardArguments, choose_path, forward_arguments

SHAPE = AttentionShape(num_heads=8, q_width=576, out_width=512, itemsize=2)
BLOCK = 16 * 576 * 2 + 8
# An owner that computes attention fast: long histories go to the owner, short ones broadcast.
FACTS = PathFacts(alone=False, group_size=2, attention=SHAPE, link=LinkModel(attention_flops_per_s=2e12),
                  has_layers=True, not_known_routed=(), unrouted=(), compact=False, crossover=0.25, num_blocks=400,
                  slot_blocks=400, block_bytes=BLOCK, layer_bytes=400 * (BLOCK - 8))


ROOT = Path(__file__).resolve().parents[2]


def facts(**changes):
    return dataclasses.replace(FACTS, **changes)


def test_broadcast_packs_up_to_the_crossover_and_sends_whole_layers_past_it():
    few = choose_path(ForwardArguments(True, blocks=list(range(100))), FACTS)
    many = choose_path(ForwardArguments(True, blocks=list(range(101))), FACTS)
    assert (few.mode, few.pack, few.broadcasts) == (BROADCAST, True, True)
    assert (many.mode, many.pack, many.broadcasts) == (BROADCAST, False, True)  # the control: past 0.25 x 400
    none = choose_path(ForwardArguments(False, blocks=[1, 2]), FACTS)
    assert not none.has_history and not none.broadcasts and not none.pack


def test_compact_slots_always_pack_and_need_the_blocks():
    assert choose_path(ForwardArguments(True, blocks=list(range(300))), facts(compact=True, slot_blocks=320)).pack
    assert choose_path(ForwardArguments(False), facts(compact=True)).pack  # an empty list: positions for the writes
    with pytest.raises(InvalidBlocksError, match="compact scratch slots hold only the blocks a step lists"):
        choose_path(ForwardArguments(True), facts(compact=True))


def test_auto_weighs_the_bytes_and_broadcasts_until_every_layer_is_routed():
    long_history = ForwardArguments(True, blocks=list(range(90)), mode=AUTO, load=StepLoad(2, 2 * 5000))
    short_history = ForwardArguments(True, blocks=[0], mode=AUTO, load=StepLoad(2, 2 * 16))
    assert choose_path(long_history, FACTS).mode == OWNER
    assert choose_path(short_history, FACTS).mode == BROADCAST  # the control: one block costs less than 2 rows
    unknown = choose_path(long_history, facts(not_known_routed=(3,)))
    assert unknown.mode == BROADCAST and "layers [3] are not known to be routed" in unknown.choice["why"]
    with pytest.raises(OwnerModeUnsupportedError, match="needs an attention shape"):
        choose_path(long_history, facts(attention=None))


def test_owner_mode_is_refused_before_anything_moves():
    with pytest.raises(OwnerModeUnsupportedError, match=r"compiled graph of layers \[1\] is not routed"):
        choose_path(ForwardArguments(True, mode=OWNER, load=StepLoad(1, 1)), facts(unrouted=(1,)))
    with pytest.raises(OwnerModeUnsupportedError, match="owner mode needs the step's load"):
        choose_path(ForwardArguments(True, mode=OWNER), FACTS)
    owner = choose_path(ForwardArguments(True, blocks=[1], mode=OWNER, load=StepLoad(1, 1)), FACTS)
    assert owner.owner and owner.exchanges and not owner.broadcasts and not owner.pack


def test_requests_take_their_own_paths_and_make_a_hybrid_forward():
    decodes = RequestRows(2, 2 * 5000, tuple(range(300)), owner_capable=True)  # past the crossover: whole layers
    prefill = RequestRows(100, 100 * 100, (350, 351), owner_capable=False, written=(352,))
    path = choose_path(ForwardArguments(True, mode=AUTO, requests=(decodes, prefill)), FACTS)
    assert path.mode == HYBRID and path.rows.modes == (OWNER, BROADCAST)
    assert path.blocks == [350, 351] and path.written == [352] and path.load == StepLoad(2, 2 * 5000)
    assert path.pack and path.broadcasts and path.exchanges
    # The controls: in broadcast mode every request broadcasts; a group of one moves nothing.
    broadcast = choose_path(ForwardArguments(True, mode=BROADCAST, requests=(decodes, prefill)), FACTS)
    assert broadcast.mode == BROADCAST and broadcast.rows.modes == (BROADCAST, BROADCAST)
    alone = choose_path(ForwardArguments(True, mode=AUTO, requests=(decodes, prefill)), facts(alone=True))
    assert alone.mode == BROADCAST and not alone.has_history and not alone.pack


def _path_in_a_fresh_process(hash_seed: int, link: str = "LinkModel(attention_flops_per_s=2e12)") -> str:
    """The path a fresh interpreter chooses for the test's step, as the agreement would compare it."""
    import subprocess
    import sys

    code = f"""
from kvpp_fx.cache.cost import AUTO, LinkModel, RequestRows
from kvpp_fx.runtime.agreement import AgreementKey
from kvpp_fx.runtime.path import ForwardArguments, choose_path
from tests.runtime.test_path import facts
step = ForwardArguments(True, mode=AUTO, requests=(RequestRows(3, 3 * 5000, tuple(range(300, 0, -1))),
                                       RequestRows(50, 2500, (341, 7, 341), owner_capable=False)))
path = choose_path(step, facts(link={link}))
print(AgreementKey.of(path, None).values(), path.rows.modes, list(path.blocks), path.mode)
"""
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                          cwd=ROOT, timeout=120).stdout.strip()


def test_equal_steps_and_facts_give_equal_paths_on_every_rank():
    """Each rank builds its own step and facts in its own process: equal values choose equal paths (what
    the per-forward agreement compares), whatever the process's hash seed (set iteration order). The
    control: another link makes the decodes broadcast."""
    first, second = _path_in_a_fresh_process(1), _path_in_a_fresh_process(2)
    assert first == second and "hybrid" in first and "('owner', 'broadcast')" in first
    slow_owner = _path_in_a_fresh_process(1, "LinkModel(attention_flops_per_s=1e6)")
    assert "('broadcast', 'broadcast')" in slow_owner and slow_owner != first


@pytest.mark.parametrize("kwargs,message", [
    ({"mode": "sideways"}, "mode must be one of"),
    ({"requests": [RequestRows(1, 1)], "blocks": [1]}, "pass none of blocks, written and load"),
    ({"requests": [(1, 1)]}, "requests must be RequestRows"),
])
def test_bad_steps_are_named(kwargs, message):
    args = {"has_history": True, "blocks": None, "written": None, "mode": BROADCAST, "load": None, "requests": None}
    with pytest.raises(ValueError, match=message):
        forward_arguments(**{**args, **kwargs})
