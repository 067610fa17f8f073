"""Models that Dynamo splits at graph breaks: each graph holds a contiguous run of the plan's layers."""

import pytest
import torch
import torch.distributed as dist

from kvpp_fx.backend import kvpp_backend
from kvpp_fx.passes.insert_checks import LayerOrderError
from kvpp_fx.runtime.runtime import KVPPRuntime
from tests.passes import toy
from tests.support.faults import DroppedBroadcast
from tests.support.launch import kvpp_group, launch
from tests.support.specs import TOY_SPECS

# Layers per Dynamo graph, in compile order, for each break (4 layers, plan order 0..3). A graph that
# does not start at layer 0 does not prefetch its first layer: the previous graph did.
GRAPH_LAYERS = {
    "between_layers": [[0, 1], [2, 3]],
    # Dynamo breaks the model's frame at the call of layer 2, then compiles layer 2's frame in two graphs:
    # its projections (no cache op) and the resumed rest with its cache ops; layer 3 resumes the model's.
    "inside_layer": [[0, 1], [], [2], [3]],
    "after_last_layer": [[0, 1, 2, 3], []],
}


def graph_break_run(rank: int, world: int, cases: list[tuple[str, str, bool]]) -> list[dict]:
    """Rank function: for each (where, mode, fault), ToyMLAWithBreak compiled by kvpp_backend (Dynamo splits
    it at the break), on `world` ranks, against the uncompiled model over replicated caches."""
    group = kvpp_group(world)
    num_layers = 4
    # A break inside a layer makes Dynamo compile each layer's frame on its own: one graph per layer and
    # shape, more than the default limit of 8 (past it Dynamo would run a layer uncompiled, which the
    # cache ops refuse: they get a handle).
    torch._dynamo.config.recompile_limit = 32
    results = []
    for where, mode, fault in cases:
        torch._dynamo.reset()
        plan = toy.toy_plan(num_layers, group_size=world)
        storage = toy.allocate(plan, dist.get_rank(group))
        backend = kvpp_backend(plan, mode=mode, inner="aot_eager" if mode == "piecewise" else "eager",
                               specs=TOY_SPECS)
        model = torch.compile(toy.ToyMLAWithBreak(where), backend=backend)
        faulty = DroppedBroadcast("cpu", position=3) if fault else None  # layer 3's owner sends zeros
        outs, broadcasts = toy.kvpp_run(model, plan, storage, group, faulty)
        reference = toy.replicated_run(toy.ToyMLAWithBreak(where), num_layers)
        results.append({
            "case": (where, mode, fault),
            "identical": [torch.equal(a, b) for a, b in zip(outs, reference)],
            "graph_layers": [list(r.layers) for r in backend.records],
            "broadcasts": broadcasts,
        })
    return results


@pytest.mark.multirank
def test_graph_breaks_on_two_ranks_equal_the_uncompiled_model():
    cases = [(where, mode, False) for where in toy.BREAKS for mode in ("eager", "piecewise")]
    cases.append(("between_layers", "eager", True))  # negative control: a suppressed broadcast of layer 3
    results = launch(graph_break_run, 2, cases, timeout_s=300)
    for rank, per_case in enumerate(results):
        for res in per_case:
            where, mode, fault = res["case"]
            if fault:  # rank 0 receives layer 3 (owned by rank 1): zeros reach its attention
                assert all(res["identical"]) is (rank == 1), (rank, res["case"])
                continue
            assert all(res["identical"]), (rank, res["case"])
            first_forward = res["graph_layers"][:len(GRAPH_LAYERS[where])]
            assert first_forward == GRAPH_LAYERS[where], (rank, res["case"], res["graph_layers"])
            for run in res["graph_layers"]:  # later steps recompile for new shapes, in the same runs
                assert run in GRAPH_LAYERS[where], (rank, res["case"], res["graph_layers"])
            assert res["broadcasts"] == [0] + [4] * (len(toy.STEPS) - 1), (rank, res["case"])


class Reordered(toy.ToyMLA):
    """Layers 2 and 3 run in a later graph than layer 0 but layer 1 runs last: not the plan's order."""

    def forward(self, x, caches, *meta):
        x = self.layers[0](x, caches[0], *meta)
        torch._dynamo.graph_break()
        for i in (2, 3, 1):
            x = self.layers[i](x, caches[i], *meta)
        return x


def test_a_graph_whose_run_is_out_of_plan_order_is_refused():
    plan = toy.toy_plan(4)
    storage = toy.allocate(plan)
    compiled = torch.compile(Reordered(4), backend=kvpp_backend(plan, specs=TOY_SPECS))
    x, *meta = toy.step_inputs(0, 5, 5)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="graph breaks") as err:
        with KVPPRuntime.create(plan, storage) as rt, rt.forward(has_history=False):
            compiled(x, toy.runtime_caches(storage, range(4)), *meta)
    assert isinstance(err.value.inner_exception, LayerOrderError)
    assert "order [2, 3, 1]" in str(err.value.inner_exception)
