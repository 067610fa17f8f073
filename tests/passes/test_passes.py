"""Insert pass, split pass and verifier on graphs captured by Dynamo from the toy model."""

import dataclasses
import operator

import pytest
import torch

from kvpp_fx.ops import is_kvpp_op
from kvpp_fx.runtime.graph_ops import RoutedOp
from kvpp_fx.passes.insert import insert_kvpp_ops
from kvpp_fx.passes.insert_checks import (
    CacheOperandError,
    LayerOrderError,
    NoGraphLayersError,
    StrayCacheReadError,
    UnguardedLayerError,
    UnknownGraphLayerError,
    UnremappedTablesError,
)
from kvpp_fx.schedule import LayerSchedule
from kvpp_fx.passes.pass_config import PassConfig, cache_op_stamp, node_value, stamp_of
from kvpp_fx.passes.registry import (
    AttentionOpSpec,
    CacheOperand,
    LayerResolutionError,
    OpMatcher,
    OwnerLocal,
    arg_location,
    default_specs,
    get_arg,
    layer_of,
    op_names,
    register_attention_op,
    set_arg,
    unregister_attention_op,
)
from kvpp_fx.passes.render import describe_pieces
from kvpp_fx.passes.route import route_owner_ops
from kvpp_fx.passes.split import Piece, split_pieces
from kvpp_fx.passes.verify import CHECKS, KVPPGraphVerificationError, verify_graph
from kvpp_fx.reference.ops import REFERENCE_SPECS
from tests.passes import toy
from tests.support.capture import capture_graph
from tests.support.specs import TOY_SPECS, pass_config

TABLE = LayerSchedule(target_layers=(0, 1, 2, 3), components={i: {"kv"} for i in range(4)})
CONFIG = pass_config(TABLE)


def capture(model=None, num_layers=4, handles=False) -> torch.fx.GraphModule:
    model = model or toy.ToyMLA(num_layers)
    caches = toy.replicated_caches(num_layers)
    if handles:
        caches = toy.runtime_caches(toy.allocate(toy.toy_plan(num_layers)), range(num_layers))
    x, *meta = toy.step_inputs(0, 3, 3)
    return capture_graph(model, x, caches, *meta)


def code_of(gm) -> str:
    """The Python code of the graph as it stands (the passes leave ``gm.code`` to their caller)."""
    return gm.graph.python_code(root_module="self").src


def kvpp_nodes(gm, kind):
    return [n for n in gm.graph.nodes if n.op == "call_function" and is_kvpp_op(n.target) and kind in str(n.target)]


def node_named(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def rewritten(config=CONFIG, **kwargs):
    gm = capture(**kwargs)
    insert_kvpp_ops(gm, config, graph_breaks=len(config.schedule.target_layers) != 4)
    return gm


def test_rewritten_graph_verifies():
    gm = rewritten()
    verify_graph(gm, CONFIG)
    assert [n.args[:2] for n in kvpp_nodes(gm, "prefetch")] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert [n.args[:2] for n in kvpp_nodes(gm, "wait")] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    for wait in kvpp_nodes(gm, "wait"):
        assert stamp_of(wait).role == "wait" and stamp_of(wait).layer == wait.args[0]
        # the layer's cache, then its tables, as the ops declare them: the slot mapping and the block table
        slot_mapping, block_table = wait.kwargs["tables"]
        assert wait.kwargs["table_kinds"] == ["slot_mapping", "block_table"]
        assert [tuple(v.shape) for v in wait.meta["val"]] == [
            (toy.BLOCKS, toy.BLOCK, toy.RANK + toy.ROPE), tuple(node_value(slot_mapping).shape),
            tuple(node_value(block_table).shape)]
        layer = wait.args[0]
        write, attn = node_named(gm, f"write_kv_{layer}" if layer else "write_kv"), \
            node_named(gm, f"attn_{layer}" if layer else "attn")
        assert (write.args[3].args, attn.args[3].args) == ((wait, 1), (wait, 2))


def test_wait_meta_is_contiguous_even_for_zero_stride_handles():
    gm = rewritten(handles=True)
    (handle,) = kvpp_nodes(gm, "wait")[0].args[2]
    assert handle.meta["example_value"].stride() == (0, 0, 0)
    for wait in kvpp_nodes(gm, "wait"):
        val = wait.meta["val"][0]
        assert val.stride() == (toy.BLOCK * (toy.RANK + toy.ROPE), toy.RANK + toy.ROPE, 1)
        (view,) = [user for user in wait.users if user.args[1] == 0]
        assert view.meta["val"].stride() == val.stride()


def test_pass_is_idempotent():
    gm = rewritten()
    code = code_of(gm)
    again = insert_kvpp_ops(gm, CONFIG)
    assert not again.changed
    assert code_of(gm) == code


def test_original_cache_values_feed_only_the_waits():
    gm = rewritten()
    caches = [n for n in gm.graph.nodes if n.op == "placeholder" and "caches" in n.name]
    assert len(caches) == 4
    for node in caches:
        assert [user.target for user in node.users] == [torch.ops.kvpp.wait.default], node.name


def test_out_of_order_layers_raise_and_mention_graph_breaks():
    with pytest.raises(LayerOrderError, match=r"order \[0, 1, 2, 3\], but the plan's execution order is "
                                              r"\[1, 0, 2, 3\].*graph breaks"):
        insert_kvpp_ops(capture(), pass_config(LayerSchedule(target_layers=(1, 0, 2, 3))))
    with pytest.raises(LayerOrderError, match="graph breaks"):  # not contiguous in the plan
        insert_kvpp_ops(capture(), pass_config(LayerSchedule(target_layers=(0, 1, 9, 2, 3))), graph_breaks=True)


def test_part_of_the_plan_needs_a_graph_break():
    with pytest.raises(LayerOrderError, match="whole compiled function"):
        insert_kvpp_ops(capture(), pass_config(LayerSchedule(target_layers=(0, 1, 2, 3, 4))))


def test_a_run_that_ends_before_the_plan_prefetches_the_next_layer():
    config = pass_config(LayerSchedule(target_layers=(0, 1, 2, 3, 4)))
    gm = rewritten(config)
    assert [n.args[:2] for n in kvpp_nodes(gm, "prefetch")] == [(0, 0), (1, 1), (2, 0), (3, 1), (4, 0)]
    last_wait = kvpp_nodes(gm, "wait")[-1]
    # right after layer 3's wait and its outputs (the view, the two tables)
    assert kvpp_nodes(gm, "prefetch")[-1].prev is last_wait.next.next.next
    verify_graph(gm, config)


def test_a_run_that_starts_after_the_plan_does_not_prefetch_its_first_layer():
    config = pass_config(LayerSchedule(target_layers=(7, 0, 1, 2, 3)))  # layer 7 ran in an earlier graph
    gm = rewritten(config)
    assert [n.args[:2] for n in kvpp_nodes(gm, "prefetch")] == [(1, 0), (2, 1), (3, 0)]
    assert [n.args[:2] for n in kvpp_nodes(gm, "wait")] == [(0, 1), (1, 0), (2, 1), (3, 0)]
    verify_graph(gm, config)


def test_unknown_layer_raises_and_leaves_graph_untouched():
    gm = capture()
    code = code_of(gm)
    with pytest.raises(UnknownGraphLayerError, match="touches layer 3"):
        insert_kvpp_ops(gm, pass_config(LayerSchedule(target_layers=(0, 1, 2))))
    assert code_of(gm) == code


@pytest.mark.parametrize("handles", [False, True])
def test_a_stray_cache_read_is_refused_and_nothing_changes(handles):
    gm = capture(toy.ToyMLAStrayRead(4), handles=handles)
    code = code_of(gm)
    with pytest.raises(StrayCacheReadError, match=r"mean.*reads the cache value 'l_caches_1_'.*specs="):
        insert_kvpp_ops(gm, CONFIG)
    assert code_of(gm) == code


def test_a_cache_op_that_declares_no_tables_is_refused_and_nothing_changes():
    """On a rank that reads a packed scratch slot, an op that reads the pool's block ids would index the
    wrong blocks: its spec must name its tables (or say the integration remaps them)."""
    attention = next(s for s in TOY_SPECS if s.op == "kvpp_ref::mla_attention")
    bare = tuple(dataclasses.replace(s, tables=()) if s is attention else s for s in TOY_SPECS)
    gm = capture()
    code = code_of(gm)
    with pytest.raises(UnremappedTablesError, match=r"attn.*reads layer 0's cache.*declares no block-table"):
        insert_kvpp_ops(gm, pass_config(TABLE, bare))
    assert code_of(gm) == code
    remapped = tuple(dataclasses.replace(s, remaps_itself=True) if s.op == attention.op else s for s in bare)
    assert insert_kvpp_ops(gm, pass_config(TABLE, remapped)).changed  # declared: the integration remaps


def test_a_cache_shared_by_two_layers_is_refused_and_nothing_changes():
    class Shared(toy.ToyMLA):
        def forward(self, x, caches, *meta):
            return super().forward(x, [caches[0], caches[1], caches[1], caches[3]], *meta)

    gm = capture(Shared(4))
    code = code_of(gm)
    with pytest.raises(CacheOperandError, match="l_caches_1_ is read as the cache of layers 1 and 2"):
        insert_kvpp_ops(gm, CONFIG)
    assert code_of(gm) == code


def test_a_view_of_a_cache_is_a_stray_read():
    class Returns(toy.ToyMLA):
        def forward(self, x, caches, *meta):
            return super().forward(x, caches, *meta), caches[2].view(-1)

    with pytest.raises(StrayCacheReadError, match="view.*l_caches_2_"):
        insert_kvpp_ops(capture(Returns(4)), CONFIG)


def test_an_unregistered_attention_op_is_never_a_silent_no_op():
    with pytest.raises(StrayCacheReadError, match="toy_unregistered.attention.*l_caches_0_"):
        insert_kvpp_ops(capture(toy.ToyUnregistered(4), handles=True), CONFIG)  # handles: the cache is known
    gm = capture(toy.ToyUnregistered(4))  # real tensors: nothing marks them as caches
    with pytest.raises(NoGraphLayersError, match=r"registered ops: \[.*'kvpp_ref::mla_attention'"):
        insert_kvpp_ops(gm, CONFIG)
    assert not insert_kvpp_ops(gm, CONFIG, graph_breaks=True).changed  # a graph break may leave a graph empty
    assert not insert_kvpp_ops(gm, pass_config(LayerSchedule(target_layers=()))).changed  # KVPP off


def test_a_layer_taken_from_an_unguarded_input_needs_a_name_table():
    class LayerName:
        def __init__(self, value):
            self.value = value

    def graph_with_input_layer():
        graph = torch.fx.Graph()
        q = graph.placeholder("q")
        name = graph.placeholder("layer_name")
        name.meta["example_value"] = LayerName("model.layers.0.self_attn.attn")
        out = graph.call_function(torch.ops.toy_vllm.unified_attention, (q, name))
        graph.output(out)
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    with pytest.raises(UnguardedLayerError, match="'layer_name'.*does not guard"):
        insert_kvpp_ops(graph_with_input_layer(), pass_config(LayerSchedule(target_layers=(0,))))
    with pytest.raises(UnguardedLayerError, match="not in the name->index map"):
        insert_kvpp_ops(graph_with_input_layer(), pass_config(LayerSchedule(target_layers=(0,), names={"other": 0})))
    gm = graph_with_input_layer()
    config = pass_config(LayerSchedule(target_layers=(0,), names={"model.layers.0.self_attn.attn": 0}))
    assert insert_kvpp_ops(gm, config).layers == (0,)
    verify_graph(gm, config)


# --- the verifier: each check rejects a graph broken in its own way, and only that check --------------

def _set_layer(node, layer, table):
    """Point a kvpp op or a registered op at another layer (slot from the table)."""
    if is_kvpp_op(node.target):
        node.update_arg(0, layer)
        node.update_arg(1, table.slot(layer))
    else:
        node.update_arg(len(node.args) - 1, layer)


def mutate_drop_final_prefetch():
    config = pass_config(LayerSchedule(target_layers=(0, 1, 2, 3, 4)))
    gm = rewritten(config)
    gm.graph.erase_node(kvpp_nodes(gm, "prefetch")[-1])
    return gm, config


def mutate_drop_a_layer_whose_ops_have_no_cache_operand():
    model = toy.ToyVLLMStyle(4)
    gm = capture(lambda x, caches, *meta: model(x))
    insert_kvpp_ops(gm, CONFIG)
    gm.graph.erase_node(next(n for n in kvpp_nodes(gm, "prefetch") if n.args[0] == 3))
    gm.graph.erase_node(next(n for n in kvpp_nodes(gm, "wait") if n.args[0] == 3))
    return gm, CONFIG


def mutate_wait_slot():
    gm = rewritten()
    kvpp_nodes(gm, "wait")[2].update_arg(1, 1)
    return gm, CONFIG


def mutate_prefetch_slot():
    gm = rewritten()
    kvpp_nodes(gm, "prefetch")[3].update_arg(1, 0)
    return gm, CONFIG


def mutate_two_prefetches_in_flight():
    gm = rewritten()
    kvpp_nodes(gm, "wait")[0].prepend(kvpp_nodes(gm, "prefetch")[1])  # prefetch L1 above wait L0
    return gm, CONFIG


def mutate_prefetch_after_its_wait():
    gm = rewritten()
    kvpp_nodes(gm, "wait")[2].append(kvpp_nodes(gm, "prefetch")[2])
    return gm, CONFIG


def mutate_layers_run_out_of_plan_order():
    config = pass_config(LayerSchedule(target_layers=(0, 1, 2, 3), depth=4))  # a slot per layer: none is reused
    gm = rewritten(config)
    swap = {2: 3, 3: 2}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if is_kvpp_op(node.target) and node.args[0] in swap:
            _set_layer(node, swap[node.args[0]], config.schedule)
        elif config.matcher(node) is not None and node.args[-1] in swap:
            _set_layer(node, swap[node.args[-1]], config.schedule)
    return gm, config


def mutate_late_reader_of_a_reused_slot():
    gm = rewritten()
    attn0 = node_named(gm, "attn")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):  # layer 0's cache read again after slot 0 is refilled for layer 2
        gm.graph.call_function(attn0.target, attn0.args)
    return gm, CONFIG


def mutate_prefetch_for_an_unknown_layer():
    gm = rewritten()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        gm.graph.call_function(torch.ops.kvpp.prefetch.default, (9, 1))
    return gm, CONFIG


def mutate_wait_for_a_draft_layer():
    config = pass_config(LayerSchedule(target_layers=(0, 1, 2, 3), draft_layers=(4,), components=TABLE.components))
    gm = rewritten(config)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        gm.graph.call_function(torch.ops.kvpp.wait.default, (4, 0, [], []))
    return gm, config


def mutate_component_name():
    gm = rewritten()
    wait = kvpp_nodes(gm, "wait")[1]
    (cache,) = wait.args[2]
    wait.update_arg(2, [cache, cache])
    wait.update_arg(3, ["kv", "kv_scale"])  # the toy bundle has only "kv"
    for user in list(wait.users):  # the tables' outputs now come after two caches
        if user.args[1] >= 1:
            user.update_arg(1, user.args[1] + 1)
    return gm, CONFIG


def mutate_table_read_unremapped():
    gm = rewritten()
    attn = node_named(gm, "attn_1")
    attn.update_arg(3, kvpp_nodes(gm, "wait")[1].kwargs["tables"][1])  # the step's block table, as given
    return gm, CONFIG


def mutate_table_of_the_wrong_kind():
    gm = rewritten()
    attn, write = node_named(gm, "attn_2"), node_named(gm, "write_kv_2")
    attn.update_arg(3, write.args[3])  # the wait's slot mapping output as the block table
    return gm, CONFIG


def mutate_cache_operand_through_a_copy():
    gm = rewritten()
    view = node_named(gm, "kv_L2")
    attn2 = node_named(gm, "attn_2")
    with gm.graph.inserting_before(attn2):
        copy = gm.graph.call_function(torch.ops.aten.clone.default, (view,))
    attn2.update_arg(2, copy)
    return gm, CONFIG


def mutate_one_original_awaited_for_two_layers():
    gm = rewritten()
    waits = kvpp_nodes(gm, "wait")
    waits[2].update_arg(2, [waits[1].args[2][0]])
    return gm, CONFIG


def mutate_extra_reader_of_an_original_cache():
    gm = rewritten()
    cache = kvpp_nodes(gm, "wait")[1].args[2][0]
    with gm.graph.inserting_after(cache):
        gm.graph.call_function(torch.ops.aten.mean.default, (cache,))
    return gm, CONFIG


def routed_graph():
    gm = rewritten()
    assert route_owner_ops(gm, CONFIG, RoutedOp).routed
    return gm


def mutate_one_wait_not_routed():
    gm = routed_graph()
    kvpp_nodes(gm, "wait")[1].update_kwarg("routed", False)
    return gm, CONFIG


def mutate_cache_op_unrouted_in_a_routed_graph():
    gm = routed_graph()
    write = node_named(gm, "write_kv_2")
    write.target = write.target.kvpp_routed_op
    return gm, CONFIG


def mutate_head_dimension_of_a_routed_op():
    gm = routed_graph()
    attn = node_named(gm, "attn_1")
    attn.target = RoutedOp(attn.target.kvpp_routed_op, 1, ((0, 2), (1, 1)), 1)
    return gm, CONFIG


def mutate_routed_op_for_another_layer():
    gm = routed_graph()
    attn = node_named(gm, "attn_3")
    attn.target = RoutedOp(attn.target.kvpp_routed_op, 2, attn.target.heads, 1)
    return gm, CONFIG


def mutate_owner_local_output_read_outside_its_layer():
    gm = routed_graph()
    write = node_named(gm, "write_kv_1")
    with gm.graph.inserting_after(write):
        gm.graph.call_function(operator.is_, (write, None))
    return gm, CONFIG


def mutate_owner_local_output_as_a_head_operand():
    gm = routed_graph()
    node_named(gm, "attn_2").update_arg(1, node_named(gm, "write_kv_2"))
    return gm, CONFIG


MUTATIONS = [
    ("counts", mutate_drop_final_prefetch, "layer 4 is prefetched 0 times, expected 1"),
    ("counts", mutate_drop_a_layer_whose_ops_have_no_cache_operand, "layer 3 is awaited 0 times"),
    ("slots", mutate_wait_slot, "kvpp_wait_L2 uses slot 1 for layer 2; the plan's slot is 0"),
    ("slots", mutate_prefetch_slot, "kvpp_prefetch_L3 uses slot 0 for layer 3"),
    ("outstanding", mutate_two_prefetches_in_flight,
     "kvpp_prefetch_L1 prefetches layer 1 while layer 0's prefetch is still outstanding"),
    ("outstanding", mutate_prefetch_after_its_wait,
     "kvpp_wait_L2 waits for layer 2, but the outstanding prefetch is none"),
    ("order", mutate_layers_run_out_of_plan_order, r"prefetches run over layers \[0, 1, 3, 2\]"),
    ("slot_reuse", mutate_late_reader_of_a_reused_slot,
     "kvpp_prefetch_L2 refills slot 0 for layer 2 before the last reader of layer 0"),
    ("layers", mutate_prefetch_for_an_unknown_layer, "layer 9, which is not a target layer"),
    ("layers", mutate_wait_for_a_draft_layer, "draft layer 4"),
    ("components", mutate_component_name, r"kvpp_wait_L1 names components \['kv', 'kv_scale'\]"),
    ("binding", mutate_cache_operand_through_a_copy, "attn_2 reads layer 2's 'kv' cache from clone"),
    ("tables", mutate_table_read_unremapped,
     "attn_1 reads its block_table from l_block_table_, not from kvpp_wait_L1's block_table output"),
    ("tables", mutate_table_of_the_wrong_kind,
     "attn_2 reads its block_table from l_slot_mapping_L2, not from kvpp_wait_L2's block_table output"),
    ("originals", mutate_extra_reader_of_an_original_cache, "mean_default reads the original cache value l_caches_1_"),
    ("originals", mutate_one_original_awaited_for_two_layers, r"is awaited as the cache of layers \[1, 2\]"),
    ("routing", mutate_one_wait_not_routed, r"waits \['kvpp_wait_L1'\] are not routed while others are"),
    ("routing", mutate_cache_op_unrouted_in_a_routed_graph, "write_kv_2 touches layer 2's cache without routing"),
    ("routing", mutate_head_dimension_of_a_routed_op,
     r"attn_1 is routed with heads \(\(0, 2\), \(1, 1\)\).*declares \(\(0, 1\), \(1, 1\)\)"),
    ("routing", mutate_routed_op_for_another_layer, "attn_3 is routed for layer 2 but touches layer 3"),
    ("routing", mutate_owner_local_output_read_outside_its_layer,
     "is_ reads the owner-local output of write_kv_1, which is None on the ranks that do not own layer 1"),
    ("routing", mutate_owner_local_output_as_a_head_operand,
     "attn_2 takes the owner-local output of write_kv_2 as a head operand"),
]


@pytest.mark.parametrize("check,mutate,message", MUTATIONS,
                         ids=[m[1].__name__.removeprefix("mutate_") for m in MUTATIONS])
def test_verifier_mutation(check, mutate, message):
    gm, config = mutate()
    with pytest.raises(KVPPGraphVerificationError, match=message) as err:
        verify_graph(gm, config)
    assert err.value.checks == {check}, str(err.value)
    assert len(err.value.problems) == len(set(err.value.problems))


def test_every_check_is_documented_and_has_a_mutation():
    import kvpp_fx.passes.verify as verify

    documented = [line.split("``")[1] for line in verify.__doc__.splitlines() if line.startswith("- ``")]
    assert documented == [name for name, _ in CHECKS]
    # pieces: tested below; run_time_layer: in tests/passes/test_run_time_layer.py, on a run-time-layer graph
    assert set(documented) - {check for check, _, _ in MUTATIONS} == {"pieces", "run_time_layer"}


def test_verifier_rejects_cache_ops_in_a_compiled_piece():
    gm = rewritten()
    split = split_pieces(gm)
    verify_graph(gm, CONFIG, split.pieces)
    eager = next(p for p in split.pieces if p.is_eager)
    disguised = Piece(eager.name, eager.index, False, eager.graph_module)
    with pytest.raises(KVPPGraphVerificationError,
                       match=f"compiled piece {eager.name} contains kvpp or cache ops") as err:
        verify_graph(gm, CONFIG, [disguised])
    assert err.value.checks == {"pieces"}


def test_split_keeps_order_and_isolates_split_points():
    gm = rewritten()
    split = split_pieces(gm)
    projections = "tanh, linear, .split, linear, .view, .split"
    expected = ["submod_0 [eager]: kvpp.prefetch(0, 0)", f"submod_1 [compiled]: {projections}"]
    for layer in range(4):
        suffix = f"_{layer}" if layer else ""
        ops = [f"kvpp.wait({layer}, {layer % 2}, [l_caches_{layer}_], ['kv'], tables=[l_slot_mapping_, "
               "l_block_table_], table_kinds=['slot_mapping', 'block_table'])"]
        ops += [f"kvpp.prefetch({layer + 1}, {(layer + 1) % 2})"] if layer < 3 else []
        ops += [f"kvpp_ref.write_kv(getitem, kv_c{suffix}, k_pe{suffix}, getitem_1, {layer})",
                f"kvpp_ref.mla_attention(q_latent{suffix}, q_pe{suffix}, getitem, getitem_2, l_seq_lens_, "
                f"l_query_lens_, 0.5, {layer})"]
        expected.append(f"submod_{2 + 2 * layer} [eager]: " + "; ".join(ops))
        rest = ".flatten, linear, add" + (f", {projections}" if layer < 3 else "")
        expected.append(f"submod_{3 + 2 * layer} [compiled]: {rest}")
    assert describe_pieces(split.pieces).splitlines() == expected


def test_registry_matching_and_user_specs():
    assert op_names(torch.ops.kvpp_ref.write_kv) == ("kvpp_ref::write_kv.default", "kvpp_ref::write_kv")
    assert op_names(torch.ops.kvpp_ref.write_kv.default) == ("kvpp_ref::write_kv.default", "kvpp_ref::write_kv")
    defaults = {s.op for s in default_specs()}
    assert defaults >= {"vllm::unified_mla_attention_with_output", "vllm::unified_mla_kv_cache_update",
                        "vllm::sparse_attn_indexer"}
    assert not {s.op for s in REFERENCE_SPECS} & defaults  # kvpp_fx.reference.ops is imported: it registers nothing
    with pytest.raises(ValueError, match="already registered"):
        register_attention_op(AttentionOpSpec("vllm::unified_mla_kv_cache_update", 0))
    with pytest.raises(ValueError, match="namespace::name"):
        AttentionOpSpec("write_kv", 0)


# --- one matcher, one configuration, one operand addressing ------------------------------------------

WRITE_KV = next(s for s in REFERENCE_SPECS if s.op == "kvpp_ref::write_kv")
# The same op named twice: as the op, without an owner rule, and as its default overload, owner-local.
WRITE_KV_AS_OP = dataclasses.replace(WRITE_KV, owner=None)
WRITE_KV_AS_DEFAULT = dataclasses.replace(WRITE_KV, op="kvpp_ref::write_kv.default", owner=OwnerLocal())


def specs_with(*write_kv_specs):
    return tuple(s for s in TOY_SPECS if s.op != "kvpp_ref::write_kv") + write_kv_specs


@pytest.mark.parametrize("order", ["op first", "overload first"])
def test_op_and_default_overload_specs_resolve_to_one_spec_everywhere(order):
    both = (WRITE_KV_AS_OP, WRITE_KV_AS_DEFAULT)
    config = pass_config(TABLE, specs=specs_with(*(both if order == "op first" else both[::-1])))
    for target in (torch.ops.kvpp_ref.write_kv, torch.ops.kvpp_ref.write_kv.default):  # Dynamo's, AOT's
        assert config.matcher.spec_for(target) is WRITE_KV_AS_DEFAULT
        assert OpMatcher(reversed(config.specs)).spec_for(target) is WRITE_KV_AS_DEFAULT
    gm = rewritten(config)
    writes = [n for n in gm.graph.nodes if n.name.startswith("write_kv")]
    assert len(writes) == 4 and all(cache_op_stamp(n).spec is WRITE_KV_AS_DEFAULT for n in writes)  # insert
    assert route_owner_ops(gm, config, RoutedOp).routed  # route read the owner-local spec from the stamps
    verify_graph(gm, config)  # the verifier, matching on its own, found the same spec
    # Controls: with the op's spec alone the graph is not routed, and a verifier that took that spec for
    # the routed graph rejects it: a disagreement between the passes and the verifier cannot pass.
    only_op = pass_config(TABLE, specs=specs_with(WRITE_KV_AS_OP))
    assert not route_owner_ops(rewritten(only_op), only_op, RoutedOp).routed
    with pytest.raises(KVPPGraphVerificationError, match="declares no owner rule") as err:
        verify_graph(gm, only_op)
    assert err.value.checks == {"routing"}


def test_the_split_reads_the_stamps_and_the_verifier_does_not():
    gm = rewritten()
    assert {cache_op_stamp(n).layer for n in gm.graph.nodes if cache_op_stamp(n) is not None} == {0, 1, 2, 3}
    verify_graph(gm, CONFIG, split_pieces(gm).pieces)
    for node in gm.graph.nodes:  # fault: stamps lost, so the split sees no cache op
        if cache_op_stamp(node) is not None:
            del node.meta["kvpp"]
    with pytest.raises(KVPPGraphVerificationError, match=r"compiled piece submod_\d+ contains kvpp or cache ops: "
                                                         r"write_kv") as err:
        verify_graph(gm, CONFIG, split_pieces(gm).pieces)
    assert err.value.checks == {"pieces"}


def test_route_refuses_to_route_ops_the_insert_pass_did_not_stamp():
    gm = rewritten()
    for node in gm.graph.nodes:
        if cache_op_stamp(node) is not None and cache_op_stamp(node).layer == 2:
            del node.meta["kvpp"]
    result = route_owner_ops(gm, CONFIG, RoutedOp)
    assert not result.routed and "layers [2]" in result.reason
    assert not any(isinstance(n.target, RoutedOp) for n in gm.graph.nodes)


def test_pass_config_is_frozen_and_refuses_two_specs_for_one_op():
    with pytest.raises(ValueError, match="two different AttentionOpSpecs for 'kvpp_ref::write_kv'"):
        pass_config(TABLE, specs=specs_with(WRITE_KV, WRITE_KV_AS_OP))
    with pytest.raises(ValueError, match="first_prefetch must be one of"):
        pass_config(TABLE, first_prefetch="later")
    with pytest.raises(AttributeError):
        CONFIG.specs = ()  # type: ignore[misc]


def test_a_pass_config_from_the_defaults_reads_them_once():
    config = PassConfig.build(TABLE)
    extra = AttentionOpSpec("toy_unregistered::attention", 1, "index", (CacheOperand(1, "kv"),))
    register_attention_op(extra)
    try:
        assert config.matcher.spec_for(torch.ops.toy_unregistered.attention) is None
        assert PassConfig.build(TABLE).matcher.spec_for(torch.ops.toy_unregistered.attention) is extra  # control
    finally:
        unregister_attention_op(extra.op)


def test_layer_names_resolve_through_table_pattern_or_fail():
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    node = graph.call_function(torch.ops.toy_vllm.unified_attention, (q, "model.layers.7.self_attn.attn"))
    spec = CONFIG.matcher(node)
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
    assert layer_of(node, CONFIG.matcher(node))[0] == 5


def test_cache_operand_by_keyword():
    spec = AttentionOpSpec("kvpp_ref::mla_attention", ("layer", 7), "index", (CacheOperand("cache", "kv"),))
    graph = torch.fx.Graph()
    args = [graph.placeholder(f"a{i}") for i in range(6)]
    node = graph.call_function(torch.ops.kvpp_ref.mla_attention.default, tuple(args) + (0.5,), {"layer": 2})
    assert layer_of(node, spec)[0] == 2
    assert get_arg(node, spec.cache_operands[0].arg) is args[2]  # found through the op's schema


@pytest.mark.parametrize("operand,args,kwargs,where", [
    (2, ("a", "b", "c"), {}, 2),
    (5, ("a", "b", "c"), {}, None),
    ("cache", ("a",), {"cache": "k"}, "cache"),
    ("cache", ("a", "b", "c"), {}, 2),  # passed positionally: found among the op's parameters
    ("cache", ("a",), {}, None),
    (("cache", 2), ("a", "b", "c"), {"cache": "k"}, "cache"),  # the keyword first
    (("cache", 2), ("a", "b", "c"), {}, 2),
    (("cache", 2), ("a",), {}, None),
])
def test_one_operand_addressing_for_the_passes_and_the_runtime(operand, args, kwargs, where):
    """`kvpp_fx.arguments` (which the runtime's routed ops use on their calls) and the passes' node helpers
    find an operand at the same place."""
    from kvpp_fx.arguments import locate, read_arg, write_arg

    parameters = ("q", "k", "cache")
    assert locate(args, kwargs, operand, parameters) == where
    assert read_arg(args, kwargs, operand, parameters) == (None if where is None else
                                                           kwargs[where] if isinstance(where, str) else args[where])
    call_args, call_kwargs = list(args), dict(kwargs)
    if where is None and not isinstance(operand, (str, tuple)):
        with pytest.raises(IndexError):
            write_arg(call_args, call_kwargs, operand, "new", parameters)
        return
    write_arg(call_args, call_kwargs, operand, "new", parameters)
    if where is None:  # not passed: by its keyword
        assert call_kwargs[operand if isinstance(operand, str) else operand[0]] == "new"
    else:
        assert read_arg(call_args, call_kwargs, operand, parameters) == "new"
    assert len(call_args) == len(args)


def test_the_node_helpers_address_operands_through_the_ops_schema():
    graph = torch.fx.Graph()
    args = [graph.placeholder(f"a{i}") for i in range(6)]
    node = graph.call_function(torch.ops.kvpp_ref.mla_attention.default, tuple(args) + (0.5,), {"layer": 2})
    assert arg_location(node, "cache") == 2 and arg_location(node, ("layer", 7)) == "layer"
    replacement = graph.placeholder("other")
    set_arg(node, "cache", replacement)
    assert node.args[2] is replacement and get_arg(node, ("cache", 2)) is replacement
    with pytest.raises(LayerResolutionError, match="has no argument 'nothing'"):
        get_arg(node, "nothing")
    with pytest.raises(LayerResolutionError, match="has no positional argument 9"):
        get_arg(node, ("nothing", 9))
