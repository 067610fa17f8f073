"""A graph break inside the layer loop: one compiled frame serves every layer, its layer a run-time value.

Dynamo cannot resume a frame inside a loop, so it runs the model's frame as Python and compiles each
layer's ``forward`` as a frame of its own. A layer index Dynamo may make dynamic (a forward argument
here, Dynamo's automatic dynamic ints) turns into a graph input from the second layer on: one graph
per input shape serves every layer, and its ``kvpp.enter_layer`` runs the plan's schedule for the layer
it is given. Everything here runs on Dynamo's default limits (``recompile_limit`` 8).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from kvpp_fx.backend import kvpp_backend
from kvpp_fx.passes.insert import insert_kvpp_ops
from kvpp_fx.passes.insert_checks import RunTimeLayerGraphError
from kvpp_fx.passes.verify import KVPPGraphVerificationError, verify_graph
from kvpp_fx.reference.ops import UnboundCacheError
from kvpp_fx.cache.cost import StepLoad
from kvpp_fx.runtime.errors import OwnerModeUnsupportedError, UnknownLayerError, WaitMismatchError
from kvpp_fx.runtime.runtime import KVPPRuntime
from tests.passes import toy
from tests.support.capture import capture_graphs
from tests.support.faults import DroppedBroadcast
from tests.support.launch import kvpp_group, launch
from tests.support.specs import TOY_SPECS, pass_config

NUM_LAYERS = 61
BREAK_AFTER = 2
FAULTY_POSITION = 7  # the target layer whose owner sends zeros in the negative control


class IndexArgLayer(toy.ToyMLALayer):
    """`ToyMLALayer` whose cache ops take the layer index its caller passes."""

    def forward(self, x, cache, index, slot_mapping, block_table, seq_lens, query_lens):
        h = torch.tanh(x)
        kv_c, k_pe = self.kv_a(h).split([toy.RANK, toy.ROPE], dim=-1)
        q_latent, q_pe = self.q(h).view(-1, toy.HEADS, toy.RANK + toy.ROPE).split([toy.RANK, toy.ROPE], dim=-1)
        torch.ops.kvpp_ref.write_kv(cache, kv_c, k_pe, slot_mapping, index)
        attn = torch.ops.kvpp_ref.mla_attention(q_latent, q_pe, cache, block_table, seq_lens, query_lens, 0.5, index)
        return x + self.o(attn.flatten(1))


class SkippedLayer(IndexArgLayer):
    """A layer whose frame Dynamo is told not to compile."""

    @torch.compiler.disable
    def forward(self, *args):
        return super().forward(*args)


class LoopWithBreak(nn.Module):
    """`num_layers` layers in a loop, with a graph break inside it after layer `BREAK_AFTER`."""

    def __init__(self, num_layers: int, layer_class: type = IndexArgLayer, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(layer_class(i) for i in range(num_layers))

    def forward(self, x, caches, *meta):
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x = layer(x, cache, i, *meta)
            if i == BREAK_AFTER:
                torch._dynamo.graph_break()
        return x


def run_loop(num_layers: int, mode: str, group=None, fault: bool = False) -> dict:
    """The model compiled by kvpp_backend over `toy.STEPS`, against the uncompiled model over replicated
    caches; with `fault`, the owner of the plan's `FAULTY_POSITION`-th layer broadcasts zeros."""
    torch._dynamo.reset()
    assert torch._dynamo.config.recompile_limit == 8, "Dynamo's default limit"
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    plan = toy.toy_plan(num_layers, group_size=world)
    storage = toy.allocate(plan, rank)
    backend = kvpp_backend(plan, mode=mode, inner="aot_eager" if mode == "piecewise" else "eager", specs=TOY_SPECS)
    model = torch.compile(LoopWithBreak(num_layers), backend=backend)
    faulty = DroppedBroadcast("cpu", position=FAULTY_POSITION) if fault else None
    outs, broadcasts = toy.kvpp_run(model, plan, storage, group, faulty)
    reference = toy.replicated_run(LoopWithBreak(num_layers), num_layers)
    return {"identical": [torch.equal(a, b) for a, b in zip(outs, reference)],
            "compiles": len(backend.records),
            "graphs": [("run-time layer" if r.run_time_layer else list(r.layers)) for r in backend.records],
            "broadcasts": broadcasts,
            "faulty_owner": plan.owners[plan.target_layers[FAULTY_POSITION]]}


@pytest.mark.parametrize("mode", ["eager", "piecewise"])
def test_61_layers_with_a_break_in_the_loop_equal_the_uncompiled_model(mode, record_property):
    res = run_loop(NUM_LAYERS, mode)
    record_property("compiles", res["compiles"])
    print(f"{NUM_LAYERS} layers, {mode}: {res['compiles']} compiles: {res['graphs']}")
    assert all(res["identical"]), res["identical"]
    # layer 0's frame is compiled with its index as a constant; from layer 1 on the index is a graph input
    assert res["graphs"][0] == [0]
    assert set(res["graphs"][1:]) == {"run-time layer"}
    assert res["compiles"] <= torch._dynamo.config.recompile_limit
    smaller = run_loop(13, mode)
    assert all(smaller["identical"])
    assert smaller["compiles"] == res["compiles"], "the compile count must not depend on the number of layers"


def loop_ranks(rank: int, world: int, cases: list[tuple[str, bool]]) -> list[dict]:
    group = kvpp_group(world)
    return [dict(run_loop(NUM_LAYERS, mode, group, fault), case=(mode, fault)) for mode, fault in cases]


@pytest.mark.multirank
def test_61_layers_on_two_ranks_equal_kvpp_off_and_a_dropped_broadcast_changes_the_output():
    cases = [("eager", False), ("piecewise", False), ("eager", True)]
    results = launch(loop_ranks, 2, cases, timeout_s=300)
    for rank, per_case in enumerate(results):
        for res in per_case:
            mode, fault = res["case"]
            assert res["broadcasts"] == [0] + [NUM_LAYERS] * (len(toy.STEPS) - 1), (rank, res["case"])
            if fault:
                # Step 1 is the first to broadcast: the faulty layer's other rank attends over zeros, its
                # owner over its own cache. From step 2 the owner differs too: it receives the history the
                # other rank wrote from its wrong hidden states.
                assert res["identical"][0], (rank, res["case"], res["identical"])
                assert res["identical"][1] is (rank == res["faulty_owner"]), (rank, res["case"], res["identical"])
                continue
            assert all(res["identical"]), (rank, res["case"], res["identical"])
            assert set(res["graphs"][1:]) == {"run-time layer"}, (rank, res["case"])


def test_a_frame_dynamo_skips_gets_a_message_that_names_the_frame_and_the_recompile_limit():
    torch._dynamo.reset()
    plan = toy.toy_plan(4)
    storage = toy.allocate(plan, 0)
    model = torch.compile(LoopWithBreak(4, SkippedLayer), backend=kvpp_backend(plan, specs=TOY_SPECS))
    x, *meta = toy.step_inputs(0, *toy.STEPS[0])
    with KVPPRuntime.create(plan, storage, None) as rt, torch.no_grad():
        with pytest.raises(UnboundCacheError) as caught, rt.forward(has_history=False):
            model(x, toy.runtime_caches(storage, range(4)), *meta)
    message = str(caught.value)
    assert "recompile_limit" in message and "forward" in message and __file__ in message, message
    assert "missing from the plan" not in message


def run_time_graph(num_layers: int = 4) -> torch.fx.GraphModule:
    """The graph Dynamo compiles for layer 1's frame: its index is a graph input (SymInt). Captured over
    real caches, so that the captured graphs run."""
    x, *meta = toy.step_inputs(0, *toy.STEPS[0])
    graphs = capture_graphs(LoopWithBreak(num_layers), x, toy.replicated_caches(num_layers), *meta, fullgraph=False)
    (graph,) = [g for g in graphs if any(isinstance(n.meta.get("example_value"), torch.SymInt)
                                         for n in g.graph.nodes if n.op == "placeholder")][:1]
    return graph


def test_the_verifier_checks_a_run_time_layer_graph_and_catches_a_handle_read():
    config = pass_config(toy.toy_plan(4))
    gm = run_time_graph()
    assert insert_kvpp_ops(gm, config, graph_breaks=True).run_time_layer
    verify_graph(gm, config)
    attention = next(n for n in gm.graph.nodes if n.target == torch.ops.kvpp_ref.mla_attention)
    enter = next(n for n in gm.graph.nodes if n.target == torch.ops.kvpp.enter_layer.default)
    attention.replace_input_with(attention.args[2], enter.args[1][0])  # the mutation: attention reads the handle
    with pytest.raises(KVPPGraphVerificationError) as caught:
        verify_graph(gm, config)
    assert {"run_time_layer", "originals"} <= caught.value.checks, caught.value


def test_the_verifier_refuses_an_enter_whose_layer_is_a_constant():
    config = pass_config(toy.toy_plan(4))
    gm = run_time_graph()
    insert_kvpp_ops(gm, config, graph_breaks=True)
    enter = next(n for n in gm.graph.nodes if n.target == torch.ops.kvpp.enter_layer.default)
    enter.update_arg(0, 1)  # the mutation: the enter names layer 1 for ops that read the run-time value
    with pytest.raises(KVPPGraphVerificationError) as caught:
        verify_graph(gm, config)
    assert caught.value.checks == {"run_time_layer"}, caught.value


def test_a_graph_mixing_a_run_time_layer_with_a_constant_one_is_refused():
    config = pass_config(toy.toy_plan(4))
    gm = run_time_graph()
    write = next(n for n in gm.graph.nodes if n.target == torch.ops.kvpp_ref.write_kv)
    write.update_arg(4, 2)  # the write now names layer 2 as a constant
    with pytest.raises(RunTimeLayerGraphError, match="exactly one layer"):
        insert_kvpp_ops(gm, config, graph_breaks=True)


def test_the_runtime_refuses_a_run_time_layer_out_of_plan_order():
    plan = toy.toy_plan(4)
    storage = toy.allocate(plan, 0)
    with KVPPRuntime.create(plan, storage, None) as rt:
        with pytest.raises(WaitMismatchError), rt.forward(has_history=False):
            rt.enter_layer(0)
            rt.enter_layer(2)  # layer 1 skipped


def test_a_local_draft_layer_gets_its_own_caches_back_and_an_unknown_layer_is_refused():
    plan = toy.toy_plan(4, drafts=1)  # layer 4 is an MTP-style draft layer, local on every rank
    storage = toy.allocate(plan, 0)
    own = torch.zeros(toy.BLOCKS, toy.BLOCK, toy.RANK + toy.ROPE)
    with KVPPRuntime.create(plan, storage, None) as rt, rt.forward(has_history=False):
        for layer in plan.target_layers:
            (view,) = torch.ops.kvpp.enter_layer(layer, toy.runtime_caches(storage, [layer]), ["kv"])
            assert view.data_ptr() == storage.typed_views(layer)["kv"].data_ptr()  # the runtime's view
        (back,) = torch.ops.kvpp.enter_layer(4, [own], ["kv"])
        assert back is own
        with pytest.raises(UnknownLayerError, match="layer 9 is not a broadcast layer"):  # the control
            torch.ops.kvpp.enter_layer(9, [own], ["kv"])


def owner_mode_ranks(rank: int, world: int) -> dict:
    """A run-time-layer model compiled and run once in broadcast mode; its compile records reported to the
    runtime as an engine reports them; then a forward in owner mode, and one more in broadcast mode."""
    group = kvpp_group(world)
    torch._dynamo.reset()
    plan = toy.toy_plan(5, group_size=world)
    storage = toy.allocate(plan, dist.get_rank(group))
    backend = kvpp_backend(plan, specs=TOY_SPECS)
    model = torch.compile(LoopWithBreak(5), backend=backend)
    caches = toy.runtime_caches(storage, plan.target_layers)
    out = {}
    with KVPPRuntime.create(plan, storage, group) as rt, torch.no_grad():
        for step in (0, 1):
            x, *meta = toy.step_inputs(step, *toy.STEPS[step])
            with rt.forward(has_history=step > 0):
                model(x, caches, *meta)
        for record in backend.records:
            rt.note_routing(*record.routed_layers(plan.target_layers))
        out["layer0_graph_routed"] = backend.records[0].owner_routed
        out["unrouted"] = rt.unrouted_layers()
        x, *meta = toy.step_inputs(2, *toy.STEPS[2])
        try:
            with rt.forward(has_history=True, mode="owner", load=StepLoad(1, 8)):
                model(x, caches, *meta)
        except OwnerModeUnsupportedError as exc:
            out["refused"] = str(exc)
        out["broken"] = rt.broken is not None
        with rt.forward(has_history=True):  # the runtime is still usable
            model(x, caches, *meta)
        out["broadcasts_after"] = rt.last_forward()["broadcasts"]
    return out


@pytest.mark.multirank
def test_owner_mode_is_refused_before_anything_moves_when_a_graph_serves_any_layer():
    for res in launch(owner_mode_ranks, 2, timeout_s=120):
        assert res["layer0_graph_routed"], "layer 0's own graph is routed: the refusal comes from the others"
        assert res["unrouted"] == [0, 1, 2, 3, 4]
        assert "not routed for it" in res["refused"], res
        assert not res["broken"] and res["broadcasts_after"] == 5
