"""A layer's turn: what the ops inside it act on, open from the layer's wait until the next layer's, and the
only way anything outside `runtime/forward.py` reaches a forward's state."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvpp_fx.runtime import errors as E
from tests.support.specs import toy_spec
from tests.support.toy_runtime import toy_runtime

PACKAGE = Path(__file__).resolve().parents[2] / "kvpp_fx"
FORWARD_HOLDERS = {"forward", "_forward"}  # the names a Forward goes by outside its own module


def test_a_turn_is_open_from_its_wait_until_the_next_wait():
    """`runtime.turn(L)` between L's wait and the next layer's, refused before and after; a turn kept past
    the next wait refuses to exchange, before anything is issued."""
    with toy_runtime(None, spec=toy_spec(3), num_blocks=4) as rt:
        schedule = rt.plan.schedule()
        with rt.forward(has_history=True):
            assert rt.path.mode == "broadcast" and not rt.owner_mode and not rt.hybrid and rt.owner_tokens == 0
            rt.prefetch(schedule.first().layer, schedule.first().slot)
            with pytest.raises(E.OwnerRoutingError, match="layer 0 ran outside its turn .no layer's is open"):
                rt.turn(0)
            view = rt.wait(0, schedule.slot(0))
            turn = rt.turn(0)
            assert (turn.layer, turn.owned, turn.view is view, rt.turn(0) is turn) == (0, True, True, True)
            with pytest.raises(E.OwnerRoutingError, match="layer 1 ran outside its turn .layer 0's is open"):
                rt.turn(1)
            with pytest.raises(E.OwnerRoutingError, match="owner mode's exchange in a broadcast-mode forward"):
                turn.owner_compute(None, [], lambda full: full[0])  # nothing goes to an owner in this forward
            rt.prefetch(1, schedule.slot(1))
            rt.wait(1, schedule.slot(1))
            with pytest.raises(E.OwnerRoutingError, match="layer 0 ran outside its turn .layer 1's is open"):
                rt.turn(0)
            with pytest.raises(E.OwnerRoutingError, match="layer 0 ran outside its turn .layer 1's is open"):
                turn.owner_compute(None, [], lambda full: full[0])  # kept past layer 1's wait
            assert rt.turn(1).layer == 1
            rt.prefetch(2, schedule.slot(2))
            rt.wait(2, schedule.slot(2))
        assert rt.path is None and rt.broken is None
        with pytest.raises(E.NoActiveForwardError):
            rt.turn(2)


def forward_field_reads(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Attribute reads on a Forward that are not a method call: on a name that holds one (``forward.x``,
    ``self._forward.x``) or on what the facade's ``_current()`` returns."""
    tree = ast.parse(path.read_text())
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    reads = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in called:
            continue
        holder = node.value
        if isinstance(holder, ast.Call):  # self._current().x
            holder = holder.func
            name = f"{holder.attr}()" if isinstance(holder, ast.Attribute) and holder.attr == "_current" else None
        else:
            name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", None)
            name = name if name in FORWARD_HOLDERS else None
        if name is not None:
            reads.append(f"{path.relative_to(root)}:{node.lineno} {name}.{node.attr}")
    return reads


def test_nothing_outside_the_forward_and_its_turn_reads_a_forwards_fields():
    """The facade, the graph ops and the integrations call a forward's methods and act on the turns it hands
    out; its fields (path, packed blocks, exchange) are its own."""
    own = {PACKAGE / "runtime" / "forward.py", PACKAGE / "runtime" / "turn.py"}
    reads = [read for path in sorted(PACKAGE.rglob("*.py")) if path not in own for read in forward_field_reads(path)]
    assert reads == []


def test_the_field_read_finder_finds_a_read(tmp_path):
    """The control: the finder sees the reads the facade used to make, and lets method calls through."""
    planted = tmp_path / "runtime.py"
    planted.write_text("def owner_mode(self):\n"
                       "    return self._forward.owner and self._forward.end(None) and self._current().active\n")
    assert forward_field_reads(planted, tmp_path) == ["runtime.py:2 _forward.owner", "runtime.py:2 _current().active"]
