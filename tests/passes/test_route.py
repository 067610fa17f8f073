"""The route pass on graphs captured by Dynamo from the toy model: what it routes, what it refuses."""

import contextlib

import pytest
import torch

from kvpp_fx.ops import RoutedOp, is_routed_op
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.passes.registry import (
    AttentionOpSpec,
    HeadOperand,
    HeadSeparable,
    OwnerLocal,
    register_attention_op,
    registered_specs,
)
from kvpp_fx.passes.route import HeadOperandError, OwnerLocalOutputError, route_owner_ops
from kvpp_fx.passes.split import split_pieces
from kvpp_fx.passes.verify import verify_graph
from kvpp_fx.backend import kvpp_backend
from tests.passes import toy
from tests.passes.test_golden import compile_and_run
from tests.passes.test_passes import TABLE, kvpp_nodes, node_named, rewritten

ATTENTION = "kvpp_ref::mla_attention"


@contextlib.contextmanager
def declared(op: str, owner):
    """Register `op` with another owner rule for the duration of a test."""
    spec = next(s for s in registered_specs() if s.op == op)
    register_attention_op(AttentionOpSpec(spec.op, spec.layer_arg, spec.layer_kind, spec.cache_operands, owner),
                          replace=True)
    try:
        yield
    finally:
        register_attention_op(spec, replace=True)


def registered_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "kvpp_ref" in str(
        getattr(n.target, "kvpp_routed_op", n.target))]


def test_every_cache_op_is_routed_with_its_declared_rule():
    gm = rewritten()
    assert route_owner_ops(gm, TABLE).routed
    verify_graph(gm.graph, TABLE, split_pieces(gm).pieces)
    assert all(w.kwargs["routed"] is True for w in kvpp_nodes(gm, "wait"))
    for node in registered_nodes(gm):
        target = node.target
        assert is_routed_op(target) and target.layer == node.args[-1]
        if "write_kv" in str(target.kvpp_routed_op):
            assert target.heads == () and target.output_dim is None
        else:  # q_latent and q_pe (positions 0 and 1) carry the heads on dimension 1, as does the output
            assert target.heads == ((0, 1), (1, 1)) and target.output_dim == 1
    assert RoutedOp(torch.ops.kvpp_ref.write_kv, 0) is RoutedOp(torch.ops.kvpp_ref.write_kv, 0)  # interned


def test_routing_twice_changes_nothing():
    gm = rewritten()
    route_owner_ops(gm, TABLE)
    code = gm.code
    assert route_owner_ops(gm, TABLE).routed
    assert gm.code == code


def test_a_graph_with_an_undeclared_cache_op_stays_broadcast_only():
    with declared(ATTENTION, None):
        gm = rewritten()
        code = gm.code
        result = route_owner_ops(gm, TABLE)
        assert not result.routed and ATTENTION in result.reason
        assert gm.code == code and not any(w.kwargs.get("routed") for w in kvpp_nodes(gm, "wait"))
        verify_graph(gm.graph, TABLE)


def test_an_owner_local_output_read_outside_the_layer_is_refused_and_nothing_changes():
    with declared(ATTENTION, OwnerLocal()):
        gm = rewritten()
        code = gm.code
        with pytest.raises(OwnerLocalOutputError, match="flatten"):
            route_owner_ops(gm, TABLE)
        assert gm.code == code and not any(is_routed_op(n.target) for n in gm.graph.nodes)


def test_head_operands_that_disagree_on_the_head_count_are_refused():
    # q_latent [T, 2, 8] carries the heads on dim 1, but dim 2 of q_pe [T, 2, 4] holds 4 values
    rule = HeadSeparable((HeadOperand(("q_latent", 0), 1), HeadOperand(("q_pe", 1), 2)), output_dim=1)
    with declared(ATTENTION, rule):
        gm = rewritten()
        with pytest.raises(HeadOperandError, match=r"disagree on the number of heads \(\[2, 4\]\)"):
            route_owner_ops(gm, TABLE)


def test_an_output_that_is_not_shaped_like_its_declared_operand_is_refused():
    # the attention output [T, 2, 8] has q_latent's shape, not q_pe's [T, 2, 4]
    rule = HeadSeparable((HeadOperand(("q_latent", 0), 1), HeadOperand(("q_pe", 1), 1)), output_dim=1, output_like=1)
    with declared(ATTENTION, rule):
        gm = rewritten()
        with pytest.raises(HeadOperandError, match="shaped like head operand 1"):
            route_owner_ops(gm, TABLE)
    rule = HeadSeparable((HeadOperand(("q_latent", 0), 1), HeadOperand(("q_pe", 1), 1)), output_dim=0)
    with declared(ATTENTION, rule):
        gm = rewritten()
        with pytest.raises(HeadOperandError, match="head dimension 0 is not that of head operand 0"):
            route_owner_ops(gm, TABLE)


def test_declarations_are_validated():
    with pytest.raises(ValueError, match="at least one head operand"):
        HeadSeparable((), output_dim=1)
    with pytest.raises(ValueError, match="output_like 2"):
        HeadSeparable((HeadOperand(0, 1),), output_dim=1, output_like=2)
    with pytest.raises(ValueError, match="HeadSeparable or an OwnerLocal"):
        AttentionOpSpec("ns::op", 0, owner="heads")


def test_routed_ops_land_in_eager_pieces():
    gm = rewritten()
    route_owner_ops(gm, TABLE)
    placed = []
    for piece in split_pieces(gm).pieces:
        routed = [n for n in piece.graph_module.graph.nodes if is_routed_op(n.target)]
        assert not routed or piece.is_eager
        placed += routed
    assert len(placed) == 8  # write_kv and mla_attention of each of the 4 layers
    assert node_named(gm, "attn_3").target.layer == 3


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "undeclared"])
def test_the_backend_tells_the_runtime_which_layers_are_routed(declare, monkeypatch):
    seen = {}
    real = KVPPRuntime.note_routing
    monkeypatch.setattr(KVPPRuntime, "note_routing",
                        lambda self, layers, routed: (seen.update(dict.fromkeys(layers, routed)),
                                                      real(self, layers, routed))[1])
    plan = toy.toy_plan(4)
    with contextlib.nullcontext() if declare else declared(ATTENTION, None):
        record = compile_and_run(toy.ToyMLA(4), kvpp_backend(plan, mode="eager"), plan, 4)
    assert record.owner_routed is declare
    assert seen == dict.fromkeys(range(4), declare)
