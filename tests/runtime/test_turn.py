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


def test_a_turn_is_handed_out_by_its_wait_and_open_until_the_next_wait():
    """`wait(L)` returns L's turn, which is the forward's open turn until the next layer's wait; a turn kept
    past the next wait, or past the forward, refuses to exchange, before anything is issued."""
    with toy_runtime(None, spec=toy_spec(3), num_blocks=4) as rt:
        schedule = rt.plan.schedule()
        with rt.forward(has_history=True):
            assert rt.path.mode == "broadcast" and not rt.path.owner and not rt.path.hybrid
            assert rt.path.owner_tokens == 0 and rt.packed_tables is None  # a group of one packs nothing
            rt.prefetch(schedule.first().layer, schedule.first().slot)
            assert rt.open_turn is None
            turn = rt.wait(0, schedule.slot(0))
            assert (turn.layer, turn.owned, rt.open_turn is turn) == (0, True, True)
            assert turn.view is rt.view(0) and turn.place.typed_views["kv"] is rt.typed_views(0)["kv"]
            assert (turn.rows_to_owner, turn.skips_cache_write, turn.packed) == (False, False, None)
            with pytest.raises(E.OwnerRoutingError, match="owner mode's exchange in a broadcast-mode forward"):
                turn.owner_compute(None, [], lambda full: full[0])  # nothing goes to an owner in this forward
            rt.prefetch(1, schedule.slot(1))
            assert rt.wait(1, schedule.slot(1)) is rt.open_turn and rt.open_turn.layer == 1
            with pytest.raises(E.OwnerRoutingError, match="layer 0 ran outside its turn .layer 1's is open"):
                turn.owner_compute(None, [], lambda full: full[0])  # kept past layer 1's wait
            rt.prefetch(2, schedule.slot(2))
            rt.wait(2, schedule.slot(2))
        assert rt.path is None and rt.broken is None
        with pytest.raises(E.NoActiveForwardError):
            rt.open_turn


def test_the_forward_hands_each_turn_to_its_listener_whoever_waits():
    """``on_turn`` gets each layer's turn as its wait opens it, from a plain wait and from ``enter_layer``
    (a graph whose layer is a run-time value, or a vLLM hook): the turn that wait returned, in layer order."""
    handed = []
    with toy_runtime(None, spec=toy_spec(3), num_blocks=4) as rt:
        schedule = rt.plan.schedule()
        with rt.forward(has_history=True, on_turn=handed.append):
            rt.prefetch(schedule.first().layer, schedule.first().slot)
            first = rt.wait(0, schedule.slot(0))
            rt.prefetch(1, schedule.slot(1))
            second = rt.enter_layer(1)
            third = rt.enter_layer(2)
        with rt.forward(has_history=True):  # no listener: nothing more is handed
            for layer in range(3):
                rt.enter_layer(layer)
    assert [turn.layer for turn in handed] == [0, 1, 2]
    assert handed[0] is first and handed[1] is second and handed[2] is third


def test_a_turn_of_a_broken_runtime_exchanges_nothing_and_names_the_cause():
    """A collective that failed inside a layer's turn broke the runtime, and the hook that saw it swallowed
    it: the next exchange of the turn raises `RuntimeBrokenError` naming that failure before anything is
    issued (a peer may no longer be in step). The control: the same call before the failure streams."""
    import torch

    with toy_runtime(None, spec=toy_spec(3), num_blocks=4) as rt:
        schedule = rt.plan.schedule()
        with pytest.raises(E.RuntimeBrokenError, match="TransferFailedError: a broadcast of layer 0 failed"):
            with rt.forward(has_history=True):
                rt.prefetch(schedule.first().layer, schedule.first().slot)
                turn = rt.wait(0, schedule.slot(0))
                rows = torch.zeros(2, 3)
                turn.stream_history(rows, lambda: rows.fill_(1.0))  # the control: a group of one streams
                assert rows.eq(1.0).all()
                try:  # as the failed collective leaves the runtime, and a hook that swallows the error
                    raise rt.parts.health.broken_by(E.TransferFailedError("a broadcast of layer 0 failed"))
                except E.TransferFailedError:
                    pass
                turn.stream_history(rows, lambda: rows.fill_(2.0))
        assert rows.eq(1.0).all() and rt.broken is not None


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


# What code outside the runtime may ask a runtime while its forward is open, by name. A turn is handed out
# (by ``wait`` and ``enter_layer``, and to ``forward(on_turn=)``'s listener), never looked up by layer.
LAYER_LOOKUPS = {"turn", "tables", "check_reads", "open_turn"}
RUNTIME_HOLDERS = {"runtime", "rt", "engine_runtime"}


def runtime_lookups(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Uses of a per-layer lookup on a runtime: ``<runtime>.turn(...)``, ``<runtime>.tables(...)``,
    ``<runtime>.open_turn`` and the like, where the holder is a name (or attribute) naming a runtime."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or node.attr not in LAYER_LOOKUPS:
            continue
        holder = node.value
        name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", None)
        if name in RUNTIME_HOLDERS:
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno} {name}.{node.attr}"))
    return [hit for _, hit in sorted(found)]


def test_no_hook_looks_a_turn_up_by_layer():
    """vLLM's hooks, the graph ops and the reference engine act on the turn they are handed: the graph's
    wait returns it, and vLLM's step hands each to the engine's state as its wait opens it (`open_turn` in
    ``engine/state.py`` reads that, not the runtime). Only the routed op, a graph target of its own that
    nothing can hand a turn to, reads the forward's open turn, and checks that it is its layer's."""
    from kvpp_fx.runtime.runtime import KVPPRuntime

    assert not hasattr(KVPPRuntime, "turn") and not hasattr(KVPPRuntime, "tables")
    allowed = {"kvpp_fx/runtime/graph_ops.py"}  # RoutedOp: ``runtime.open_turn``, checked by layer
    hooks = [p for p in sorted(PACKAGE.rglob("*.py")) if "runtime" not in p.relative_to(PACKAGE).parts[:1]]
    hooks.append(PACKAGE / "runtime" / "graph_ops.py")
    found = [hit for path in hooks for hit in runtime_lookups(path)
             if str(path.relative_to(PACKAGE.parent)) not in allowed]
    assert found == []
    assert runtime_lookups(PACKAGE / "runtime" / "graph_ops.py") == [
        f"kvpp_fx/runtime/graph_ops.py:{_line_of('turn = runtime.open_turn')} runtime.open_turn"]


def _line_of(text: str) -> int:
    lines = (PACKAGE / "runtime" / "graph_ops.py").read_text().splitlines()
    return next(k for k, line in enumerate(lines, 1) if text in line)


def test_the_lookup_finder_finds_a_lookup(tmp_path):
    """The control: the lookups the vLLM hooks used to make are found; a turn's own methods are not."""
    planted = tmp_path / "hook.py"
    planted.write_text("def forward_mqa(self, turn, runtime):\n"
                       "    part = runtime.turn(self._kvpp_layer).owner_compute(rule, [q], f)\n"
                       "    (t,) = self._kvpp_engine.comm.runtime.tables(3, [table], ['block_table'])\n"
                       "    return turn.tables([t], ['block_table']), turn.owner_compute(rule, [q], f)\n")
    assert runtime_lookups(planted, tmp_path) == ["hook.py:2 runtime.turn", "hook.py:3 runtime.tables"]
