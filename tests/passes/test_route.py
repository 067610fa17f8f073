"""The route pass on graphs captured by Dynamo from the toy model: what it routes, what it refuses."""

import dataclasses

import pytest
import torch

from kvpp_fx.ops import is_routed_op
from kvpp_fx.runtime.graph_ops import RoutedOp
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.passes.pass_config import PassConfig
from kvpp_fx.passes.registry import AttentionOpSpec, HeadOperand, HeadSeparable, OwnerLocal
from kvpp_fx.passes.route import HeadOperandError, OwnerLocalOutputError, route_owner_ops
from kvpp_fx.passes.split import split_pieces
from kvpp_fx.passes.verify import verify_graph
from kvpp_fx.backend import kvpp_backend
from tests.passes import toy
from tests.passes.test_passes import CONFIG, TABLE, code_of, kvpp_nodes, node_named, rewritten
from tests.support.specs import TOY_SPECS, pass_config

ATTENTION = "kvpp_ref::mla_attention"


def declared_specs(op: str, owner) -> tuple[AttentionOpSpec, ...]:
    """The toy specs with `op` declared by another owner rule."""
    return tuple(dataclasses.replace(s, owner=owner) if s.op == op else s for s in TOY_SPECS)


def declared(op: str, owner) -> PassConfig:
    return pass_config(TABLE, specs=declared_specs(op, owner))


def registered_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "kvpp_ref" in str(
        getattr(n.target, "kvpp_routed_op", n.target))]


def test_every_cache_op_is_routed_with_its_declared_rule():
    gm = rewritten()
    assert route_owner_ops(gm, CONFIG, RoutedOp).routed
    verify_graph(gm, CONFIG, split_pieces(gm).pieces)
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
    route_owner_ops(gm, CONFIG, RoutedOp)
    code = code_of(gm)
    assert "routed_heads" in code
    assert route_owner_ops(gm, CONFIG, RoutedOp).routed
    assert code_of(gm) == code


def test_a_graph_with_an_undeclared_cache_op_stays_broadcast_only():
    config = declared(ATTENTION, None)
    gm = rewritten(config)
    code = code_of(gm)
    result = route_owner_ops(gm, config, RoutedOp)
    assert not result.routed and ATTENTION in result.reason
    assert code_of(gm) == code and not any(w.kwargs.get("routed") for w in kvpp_nodes(gm, "wait"))
    verify_graph(gm, config)


def test_an_owner_local_output_read_outside_the_layer_is_refused_and_nothing_changes():
    config = declared(ATTENTION, OwnerLocal())
    gm = rewritten(config)
    code = code_of(gm)
    with pytest.raises(OwnerLocalOutputError, match="flatten"):
        route_owner_ops(gm, config, RoutedOp)
    assert code_of(gm) == code and not any(is_routed_op(n.target) for n in gm.graph.nodes)


def test_head_operands_that_disagree_on_the_head_count_are_refused():
    # q_latent [T, 2, 8] carries the heads on dim 1, but dim 2 of q_pe [T, 2, 4] holds 4 values
    config = declared(ATTENTION, HeadSeparable((HeadOperand(("q_latent", 0), 1), HeadOperand(("q_pe", 1), 2)),
                                               output_dim=1))
    with pytest.raises(HeadOperandError, match=r"disagree on the number of heads \(\[2, 4\]\)"):
        route_owner_ops(rewritten(config), config, RoutedOp)


def test_an_output_that_is_not_shaped_like_its_declared_operand_is_refused():
    # the attention output [T, 2, 8] has q_latent's shape, not q_pe's [T, 2, 4]
    config = declared(ATTENTION, HeadSeparable((HeadOperand(("q_latent", 0), 1), HeadOperand(("q_pe", 1), 1)),
                                               output_dim=1, output_like=1))
    with pytest.raises(HeadOperandError, match="shaped like head operand 1"):
        route_owner_ops(rewritten(config), config, RoutedOp)
    config = declared(ATTENTION, HeadSeparable((HeadOperand(("q_latent", 0), 1), HeadOperand(("q_pe", 1), 1)),
                                               output_dim=0))
    with pytest.raises(HeadOperandError, match="head dimension 0 is not that of head operand 0"):
        route_owner_ops(rewritten(config), config, RoutedOp)


def test_declarations_are_validated():
    with pytest.raises(ValueError, match="at least one head operand"):
        HeadSeparable((), output_dim=1)
    with pytest.raises(ValueError, match="output_like 2"):
        HeadSeparable((HeadOperand(0, 1),), output_dim=1, output_like=2)
    with pytest.raises(ValueError, match="a HeadSeparable, an OwnerLocal or a RoutesItself"):
        AttentionOpSpec("ns::op", 0, owner="heads")
    from kvpp_fx.passes.registry import RowOperands

    with pytest.raises(ValueError, match="query_lens 'lens' must be one of the request operands"):
        RowOperands(("q",), ("table",), "lens")
    with pytest.raises(ValueError, match="head operand 'k' must be a token operand of rows="):
        HeadSeparable((HeadOperand("q", 1), HeadOperand("k", 1)), output_dim=1,
                      rows=RowOperands(("q",), ("lens",), "lens"))
    with pytest.raises(ValueError, match="tokens on dimension 0"):
        HeadSeparable((HeadOperand("q", 0, token_dim=1),), output_dim=0, rows=RowOperands(("q",), ("lens",), "lens"))


def test_routed_ops_land_in_eager_pieces():
    gm = rewritten()
    route_owner_ops(gm, CONFIG, RoutedOp)
    placed = []
    for piece in split_pieces(gm).pieces:
        routed = [n for n in piece.graph_module.graph.nodes if is_routed_op(n.target)]
        assert not routed or piece.is_eager
        placed += routed
    assert len(placed) == 8  # write_kv and mla_attention of each of the 4 layers
    assert node_named(gm, "attn_3").target.layer == 3


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "undeclared"])
def test_the_compile_record_says_which_layers_are_routed_and_the_runtime_is_not_told(declare):
    plan = toy.toy_plan(4)
    specs = TOY_SPECS if declare else declared_specs(ATTENTION, None)
    storage = toy.allocate(plan)
    backend = kvpp_backend(plan, mode="eager", specs=specs)
    compiled = torch.compile(toy.ToyMLA(4), backend=backend, fullgraph=True)
    x, *meta = toy.step_inputs(0, 3, 3)
    with KVPPRuntime.create(plan, storage) as rt, rt.forward(has_history=False):
        compiled(x, toy.runtime_caches(storage, range(4)), *meta)
        assert rt.routing() == {}  # what owns both the backend and the runtime tells it (the engine)
    (record,) = backend.records
    assert record.layers == (0, 1, 2, 3) and record.owner_routed is declare
