"""The kvpp ops survive every backend: neither Dynamo, AOT nor inductor deletes them."""

import pytest
import torch

import kvpp_fx.ops  # noqa: F401
from kvpp_fx.runtime.errors import NoActiveForwardError
from tests.runtime.test_runtime_errors import make_runtime


def only_side_effects(x, cache):
    torch.ops.kvpp.prefetch(0, 0)
    torch.ops.kvpp.wait(0, 0, [cache], ["kv"])  # result unused: only its effect keeps it
    return x * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_ops_are_not_dead_code(backend):
    rt = make_runtime(num_layers=1)
    calls = []
    prefetch, wait = rt.prefetch, rt.wait
    rt.prefetch = lambda layer, slot: (calls.append(("prefetch", layer)), prefetch(layer, slot))[1]
    rt.wait = lambda layer, slot, **kw: (calls.append(("wait", layer)), wait(layer, slot, **kw))[1]
    compiled = torch.compile(only_side_effects, backend=backend, fullgraph=True)
    with rt, rt.forward(has_history=True):  # the forward also fails if the wait was dropped
        out = compiled(torch.ones(3), rt.handles(0)["kv"])
    assert calls == [("prefetch", 0), ("wait", 0)]
    assert torch.equal(out, torch.full((3,), 2.0))


def test_ops_outside_a_forward_raise_a_named_error():
    with pytest.raises(NoActiveForwardError):
        torch.ops.kvpp.prefetch(0, 0)


def test_wait_checks_the_graph_cache_against_the_runtime_view():
    rt = make_runtime(num_layers=1)
    with rt, rt.forward(has_history=False):
        torch.ops.kvpp.prefetch(0, 0)
        with pytest.raises(ValueError, match=r"the graph's 'kv' cache is \(2, 3\)"):
            torch.ops.kvpp.wait(0, 0, [torch.zeros(2, 3)], ["kv"])


def test_fake_impls_propagate_shapes():
    from torch._subclasses import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        handle = torch.empty((), dtype=torch.bfloat16).expand(4, 4, 8)  # a zero-stride KVPP handle
        (view,) = torch.ops.kvpp.wait(0, 0, [handle], ["kv"])
        assert torch.ops.kvpp.prefetch(1, 1) is None
    assert isinstance(view, FakeTensor)
    assert view.shape == (4, 4, 8) and view.dtype == torch.bfloat16
    assert view.stride() == (32, 8, 1)  # the runtime's views are contiguous, unlike the handle
