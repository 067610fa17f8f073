"""Insert pass, split pass and verifier on graphs captured by Dynamo from the toy model."""

import pytest
import torch

from kvpp_fx.ops import is_kvpp_op
from kvpp_fx.passes.insert import LayerOrderError, UnknownGraphLayerError, insert_kvpp_ops
from kvpp_fx.passes.layer_table import LayerTable
from kvpp_fx.passes.registry import (
    AttentionOpSpec,
    CacheOperand,
    LayerResolutionError,
    find_spec,
    get_arg,
    layer_of,
    op_names,
    register_attention_op,
    registered_specs,
)
from kvpp_fx.passes.split import Piece, split_pieces
from kvpp_fx.passes.verify import KVPPGraphVerificationError, verify_graph
from tests.passes import toy

TABLE = LayerTable(target_layers=(0, 1, 2, 3))


def capture(num_layers=4) -> torch.fx.GraphModule:
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    model = torch.compile(toy.ToyMLA(num_layers), backend=grab, fullgraph=True)
    x, *meta = toy.step_inputs(0, 3, 3)
    model(x, toy.replicated_caches(num_layers), *meta)
    return graphs[0]


def kvpp_nodes(gm, kind):
    return [n for n in gm.graph.nodes if n.op == "call_function" and is_kvpp_op(n.target) and kind in str(n.target)]


def rewritten():
    gm = capture()
    insert_kvpp_ops(gm, TABLE)
    return gm


def test_rewritten_graph_verifies():
    gm = rewritten()
    verify_graph(gm.graph, TABLE)
    assert [n.args[:2] for n in kvpp_nodes(gm, "prefetch")] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert [n.args[:2] for n in kvpp_nodes(gm, "wait")] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    for wait in kvpp_nodes(gm, "wait"):
        assert wait.meta["kvpp"]["role"] == "wait" and wait.meta["kvpp"]["layer"] == wait.args[0]
        assert [tuple(v.shape) for v in wait.meta["val"]] == [(toy.BLOCKS, toy.BLOCK, toy.RANK + toy.ROPE)]


def test_pass_is_idempotent():
    gm = rewritten()
    code = gm.code
    again = insert_kvpp_ops(gm, TABLE)
    assert not again.changed
    assert gm.code == code


def test_original_cache_values_feed_only_the_waits():
    gm = rewritten()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "caches" in node.name:
            assert all(is_kvpp_op(user.target) for user in node.users), node.name


def test_out_of_order_layers_raise():
    with pytest.raises(LayerOrderError, match=r"order \[0, 1, 2, 3\], but the plan's execution order is \[1, 0, 2, 3\]"):
        insert_kvpp_ops(capture(), LayerTable(target_layers=(1, 0, 2, 3)))
    with pytest.raises(LayerOrderError):  # a layer the plan expects never appears
        insert_kvpp_ops(capture(), LayerTable(target_layers=(0, 1, 2, 3, 4)))


def test_unknown_layer_raises_and_leaves_graph_untouched():
    gm = capture()
    code = gm.code
    with pytest.raises(UnknownGraphLayerError, match="touches layer 3"):
        insert_kvpp_ops(gm, LayerTable(target_layers=(0, 1, 2)))
    assert gm.code == code


def test_verifier_rejects_a_removed_wait():
    gm = rewritten()
    wait = next(n for n in kvpp_nodes(gm, "wait") if n.args[0] == 2)
    original = wait.args[2][0]
    for view in list(wait.users):
        view.replace_all_uses_with(original)
        gm.graph.erase_node(view)
    gm.graph.erase_node(wait)
    with pytest.raises(KVPPGraphVerificationError, match="touches layer 2's cache before \\(or without\\) its wait"):
        verify_graph(gm.graph, TABLE)


def test_verifier_rejects_prefetch_after_its_wait():
    gm = rewritten()
    prefetch = next(n for n in kvpp_nodes(gm, "prefetch") if n.args[0] == 2)
    wait = next(n for n in kvpp_nodes(gm, "wait") if n.args[0] == 2)
    wait.append(prefetch)  # moves the prefetch right after the wait
    with pytest.raises(KVPPGraphVerificationError, match="layer 2's prefetch comes after its wait"):
        verify_graph(gm.graph, TABLE)


def test_verifier_rejects_slot_reused_before_last_reader():
    gm = rewritten()
    prefetch_l2 = next(n for n in kvpp_nodes(gm, "prefetch") if n.args[0] == 2)
    prefetch_l1 = next(n for n in kvpp_nodes(gm, "prefetch") if n.args[0] == 1)
    prefetch_l1.append(prefetch_l2)  # slot 0 refilled while layer 0's attention still reads it
    with pytest.raises(KVPPGraphVerificationError, match="slot 0 is prefetched for layer 2 before the last reader of layer 0"):
        verify_graph(gm.graph, TABLE)


def test_verifier_rejects_cache_ops_in_a_compiled_piece():
    gm = rewritten()
    split = split_pieces(gm)
    verify_graph(gm.graph, TABLE, split.pieces)
    eager = next(p for p in split.pieces if p.is_eager)
    disguised = Piece(eager.name, eager.index, False, eager.graph_module)
    with pytest.raises(KVPPGraphVerificationError, match=f"compiled piece {eager.name} contains kvpp or cache ops"):
        verify_graph(gm.graph, TABLE, [disguised])


def test_split_keeps_order_and_isolates_split_points():
    gm = rewritten()
    split = split_pieces(gm)
    kinds = [p.is_eager for p in split.pieces]
    assert kinds == [True, False] + [True, False] * 4
    for piece in split.pieces:
        has_split_op = any(find_spec(n) or (n.op == "call_function" and is_kvpp_op(n.target))
                           for n in piece.graph_module.graph.nodes)
        assert has_split_op == piece.is_eager


def test_registry_matching_and_user_specs():
    assert op_names(torch.ops.kvpp_ref.write_kv) == {"kvpp_ref::write_kv", "kvpp_ref::write_kv.default"}
    assert op_names(torch.ops.kvpp_ref.write_kv.default) == {"kvpp_ref::write_kv", "kvpp_ref::write_kv.default"}
    assert {s.op for s in registered_specs()} >= {
        "vllm::unified_mla_attention_with_output", "vllm::unified_mla_kv_cache_update",
        "vllm::sparse_attn_indexer", "kvpp_ref::write_kv", "kvpp_ref::mla_attention"}
    with pytest.raises(ValueError, match="already registered"):
        register_attention_op(AttentionOpSpec("kvpp_ref::write_kv", 0))
    with pytest.raises(ValueError, match="namespace::name"):
        AttentionOpSpec("write_kv", 0)


def test_layer_names_resolve_through_table_pattern_or_fail():
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    node = graph.call_function(torch.ops.toy_vllm.unified_attention, (q, "model.layers.7.self_attn.attn"))
    spec = find_spec(node)
    assert layer_of(node, spec) == (7, "model.layers.7.self_attn.attn")
    assert layer_of(node, spec, {"model.layers.7.self_attn.attn": 3})[0] == 3
    odd = graph.call_function(torch.ops.toy_vllm.unified_attention, (q, "decoder.block_seven"))
    with pytest.raises(LayerResolutionError, match="give the pass a name table"):
        layer_of(odd, spec)


def test_layer_name_from_a_placeholder_example_value():
    class LayerName:  # what vLLM hands Dynamo: an opaque object carrying the name
        def __init__(self, value):
            self.value = value

    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    name = graph.placeholder("layer_name")
    name.meta["example_value"] = LayerName("model.layers.5.self_attn.attn")
    node = graph.call_function(torch.ops.toy_vllm.unified_attention, (q, name))
    assert layer_of(node, find_spec(node))[0] == 5


def test_cache_operand_by_keyword():
    spec = AttentionOpSpec("kvpp_ref::mla_attention", ("layer", 7), "index", (CacheOperand("cache", "kv"),))
    graph = torch.fx.Graph()
    args = [graph.placeholder(f"a{i}") for i in range(6)]
    node = graph.call_function(torch.ops.kvpp_ref.mla_attention.default, tuple(args) + (0.5,), {"layer": 2})
    assert layer_of(node, spec)[0] == 2
    assert get_arg(node, spec.cache_operands[0].arg) is args[2]  # found through the op's schema
