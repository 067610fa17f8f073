"""Models that Dynamo splits at graph breaks: each graph holds a contiguous run of the plan's layers."""

import pytest
import torch

from kvpp_fx.backend import kvpp_backend
from kvpp_fx.launch import run_ranks
from kvpp_fx.passes.insert import LayerOrderError
from kvpp_fx.runtime.runtime import KVPPRuntime
from tests.passes import toy, workers

# Layers per Dynamo graph, in compile order, for each break (4 layers, plan order 0..3). A graph that
# does not start at layer 0 does not prefetch its first layer: the previous graph did.
GRAPH_LAYERS = {
    "between_layers": [[0, 1], [2, 3]],
    # Dynamo breaks the model's frame at the call of layer 2, then compiles layer 2's frame in two graphs:
    # its projections (no cache op) and the resumed rest with its cache ops; layer 3 resumes the model's.
    "inside_layer": [[0, 1], [], [2], [3]],
    "after_last_layer": [[0, 1, 2, 3], []],
}


@pytest.mark.multirank
def test_graph_breaks_on_two_ranks_equal_the_uncompiled_model():
    cases = [(where, mode, False) for where in toy.BREAKS for mode in ("eager", "piecewise")]
    cases.append(("between_layers", "eager", True))  # negative control: a suppressed broadcast of layer 3
    results = run_ranks(workers.graph_break_run, 2, cases, timeout_s=300)
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
            assert res["broadcasts"] == [0] + [4] * (len(workers.STEPS) - 1), (rank, res["case"])


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
    compiled = torch.compile(Reordered(4), backend=kvpp_backend(plan))
    x, *meta = toy.step_inputs(0, 5, 5)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="graph breaks") as err:
        with KVPPRuntime.create(plan, storage) as rt, rt.forward(has_history=False):
            compiled(x, toy.runtime_caches(storage, range(4)), *meta)
    assert isinstance(err.value.inner_exception, LayerOrderError)
    assert "order [2, 3, 1]" in str(err.value.inner_exception)
