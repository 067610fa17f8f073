"""An engine's state as its hooks read it: the turn its step's forward hands it, and one writer per part."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

from kvpp_fx.integrations.vllm.engine.state import Communication, EngineState, open_runtime, open_turn
from kvpp_fx.runtime import errors as E
from tests.support.specs import toy_spec
from tests.support.toy_runtime import toy_runtime

PACKAGE = Path(__file__).resolve().parents[3] / "kvpp_fx" / "integrations" / "vllm"


def test_hooks_get_the_turn_the_forward_handed_to_their_engine():
    """Inside the engine's forward, `open_turn` is the turn its listener was handed, for that layer only;
    outside it, or in another engine's forward, hooks see nothing (vLLM's own path runs)."""
    with toy_runtime(None, spec=toy_spec(3), num_blocks=4) as rt:
        state = EngineState(config=types.SimpleNamespace(pcp=1), vllm_config=None, comm=Communication(runtime=rt))
        other = EngineState(config=types.SimpleNamespace(pcp=1), vllm_config=None)
        assert open_runtime(state) is None and open_turn(state, 0) is None
        with rt.forward(has_history=True, on_turn=state.step.take_turn):
            assert open_runtime(state) is rt and open_runtime(other) is None and open_turn(other, 0) is None
            with pytest.raises(E.OwnerRoutingError, match="layer 0 ran outside its turn .no layer's is open"):
                open_turn(state, 0)  # before the layer's wait
            turn = rt.enter_layer(0)
            assert open_turn(state, 0) is turn
            with pytest.raises(E.OwnerRoutingError, match="layer 1 ran outside its turn .layer 0's is open"):
                open_turn(state, 1)
            rt.enter_layer(1)
            rt.enter_layer(2)
            assert open_turn(state, 2).layer == 2
        assert open_turn(state, 2) is None  # the forward closed


# Each part of an engine's state and the one module that assigns it (`EngineState`'s docstring); StepState
# and Counters change only through their own methods.
WRITERS = {"layout": "cache/layout.py", "attention": "attention/model_hooks.py", "comm": "cache/allocation.py"}
PARTS = {"layout", "attention", "comm", "step", "counters"}


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr | None]]:
    if isinstance(target, ast.Tuple):
        values = value.elts if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts) else None
        return [(t, values[k] if values else None) for k, t in enumerate(target.elts)]
    return [(target, value)]


def part_writes(path: Path) -> list[tuple[str, str]]:
    """(part, field) of each assignment ``<...>.<part>.<field> = ...`` (or augmented) in `path`, also through
    a local name bound to a part (``comm = state.comm``, then ``comm.runtime = ...``)."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}  # local name -> the part it was bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name, value in _pairs(target, node.value):
                    if (isinstance(name, ast.Name) and isinstance(value, ast.Attribute) and value.attr in PARTS):
                        aliases[name.id] = value.attr
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if not isinstance(element, ast.Attribute):
                    continue
                holder = element.value
                if isinstance(holder, ast.Attribute) and holder.attr in PARTS:
                    found.append((node.lineno, holder.attr, element.attr))
                elif isinstance(holder, ast.Name) and holder.id in aliases:
                    found.append((node.lineno, aliases[holder.id], element.attr))
    return [(part, name) for _, part, name in sorted(found)]


def test_each_part_of_an_engines_state_has_one_writer():
    """Layout is written by `layout`, the attention choices by `model_hooks`, the groups and the runtime by
    `allocation`; the step's state and the counters by no one but their own methods."""
    writes = {str(path.relative_to(PACKAGE)): part_writes(path) for path in sorted(PACKAGE.rglob("*.py"))}
    wrong = [(module, part, name) for module, found in writes.items() for part, name in found
             if part in ("step", "counters") or WRITERS.get(part) != module]
    assert wrong == []
    assert {part for module, found in writes.items() for part, _ in found} == set(WRITERS)


def test_the_writer_finder_finds_a_write(tmp_path):
    """The control: a hook that sets the layout's plan or bumps a counter is found."""
    planted = tmp_path / "hook.py"
    planted.write_text("def hook(state):\n    state.layout.vplan = None\n    state.counters.steps += 1\n"
                       "    state.comm.runtime, x = None, 1\n    state.config.tp = 2\n"
                       "    step, y = state.step, 0\n    step.turn = None\n")
    assert part_writes(planted) == [("layout", "vplan"), ("counters", "steps"), ("comm", "runtime"),
                                    ("step", "turn")]


def test_a_sparse_steps_load_counts_at_most_top_k_keys_per_query():
    """The load "auto" weighs for an SFA step whose rows may all go to the owners: a query token scores at most
    top-k keys. By hand, top-k 12: 10 computed + 3 new score 11 + 12 + 12; a fresh 5-token prompt 1 + ... + 5; one
    decode after 1,000 tokens 12. Dense attention would score 36 + 15 + 1,001 (the control)."""
    import numpy as np

    from kvpp_fx.integrations.vllm.engine.step import sparse_pairs

    from kvpp_fx.cache.cost import scored_pairs

    batch = types.SimpleNamespace(num_computed=np.array([10, 0, 1000]), query_lens=np.array([3, 5, 1]))
    assert sparse_pairs(batch, 12) == 35 + 15 + 12
    assert sparse_pairs(batch, 1 << 20) == 36 + 15 + 1001
    # the scalar form the planner and the reference engine count with, request by request
    for topk in (1, 4, 12, 1 << 20):
        assert sparse_pairs(batch, topk) == sum(scored_pairs(int(q), int(h), topk) for q, h in (
            zip(batch.query_lens, batch.num_computed))), topk
    assert [scored_pairs(3, 10), scored_pairs(5, 0), scored_pairs(1, 1000)] == [36, 15, 1001]


def test_owner_only_slots_send_every_step_to_the_owners_or_refuse_it():
    """With owner-only slots (an SFA model's, which hold no layer), every step's rows go to the owners whatever the
    engine's mode, broadcast included, with the step's sparse load; a step whose metadata leaves a row out of the
    decode rows is refused by name before anything moves. The control: on whole-layer slots the same steps take
    the engine's mode, and the partial one broadcasts whole layers (no arguments)."""
    import numpy as np

    from kvpp_fx.cache.cost import Mode, RequestRows, StepLoad
    from kvpp_fx.integrations.vllm.attention.owner_rows import OwnerRowsUnsupportedError
    from kvpp_fx.integrations.vllm.engine.state import AttentionChoices, Layout
    from kvpp_fx.integrations.vllm.engine.step import whole_layer_rows

    model_config = types.SimpleNamespace(hf_text_config=types.SimpleNamespace(index_topk=12))
    batch = types.SimpleNamespace(num_computed=np.array([10, 0]), query_lens=np.array([1, 5]), num_reqs=2)
    group = RequestRows(6, 0)
    load = StepLoad(6, 11 + 15)

    def state(owner_only: bool, mode: Mode) -> EngineState:
        return EngineState(config=types.SimpleNamespace(pcp=1), vllm_config=types.SimpleNamespace(
            model_config=model_config), layout=Layout(scratch_blocks=1 if owner_only else None, owner_only=owner_only),
            attention=AttentionChoices(mode=mode))

    for mode in (Mode.AUTO, Mode.OWNER, Mode.BROADCAST):
        assert whole_layer_rows(state(True, mode), batch, ((group,), 2)) == {"mode": Mode.OWNER, "load": load}
        assert whole_layer_rows(state(False, mode), batch, ((group,), 2)) == {"mode": mode, "load": load}
        for rows in (((group,), 1), None):
            with pytest.raises(OwnerRowsUnsupportedError, match="owner-only slots hold no layer.*'broadcast' from"):
                whole_layer_rows(state(True, mode), batch, rows)
            assert whole_layer_rows(state(False, mode), batch, rows) == {}
