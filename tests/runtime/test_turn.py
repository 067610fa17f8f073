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
    with toy_runtime(None, spec=toy_spec(3), num_blocks=4) as rt:
        schedule = rt.plan.schedule()
        with rt.forward(has_history=True):
            assert rt.path.mode == "broadcast" and not rt.owner_mode and not rt.hybrid and rt.owner_tokens == 0
            first = schedule.first()
            rt.prefetch(first.layer, first.slot)
            with pytest.raises(E.OwnerRoutingError, match="layer 0 ran outside its turn"):
                rt.turn(0)  # before its wait
            view = rt.wait(0, schedule.slot(0))
            turn = rt.turn(0)
            assert (turn.layer, turn.owned) == (0, True) and turn.view is view
            with pytest.raises(E.OwnerRoutingError, match="outside its turn"):
                rt.turn(1)
            with pytest.raises(E.OwnerRoutingError, match="owner mode's exchange in a broadcast-mode forward"):
                turn.owner_compute(None, [], lambda full: full[0])  # nothing goes to an owner in this forward
            for step in schedule.at_layer(0)[1:]:
                rt.prefetch(step.layer, step.slot)
            rt.wait(1, schedule.slot(1))
            with pytest.raises(E.OwnerRoutingError, match="last awaited layer is 1"):
                rt.turn(0)  # closed by layer 1's wait
            assert rt.turn(1).layer == 1
            for layer in (1, 2):
                for step in schedule.at_layer(layer)[1 if layer == 1 else 0:]:
                    if step.kind == "wait":
                        rt.wait(step.layer, step.slot)
                    else:
                        rt.prefetch(step.layer, step.slot)
        assert rt.path is None
        with pytest.raises(E.NoActiveForwardError):
            rt.turn(2)


def forward_field_reads(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Attribute reads on a name that holds a Forward (``forward.x``, ``self._forward.x``) that are not a
    method call: a read of the forward's state."""
    tree = ast.parse(path.read_text())
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    reads = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in called:
            continue
        holder = node.value
        name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", None)
        if name in FORWARD_HOLDERS:
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
    planted.write_text("def owner_mode(self):\n    return self._forward.owner and self._forward.end(None)\n")
    assert forward_field_reads(planted, tmp_path) == ["runtime.py:2 _forward.owner"]
