"""kvpp_backend end to end: options, dumps, inductor pieces, and KVPP == replicated on 2 gloo ranks."""

import contextlib
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from kvpp_fx.backend import KVPPBackendError, PlanChangedError, TorchairNotInstalledError, kvpp_backend
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.passes.insert_checks import StrayCacheReadError
from kvpp_fx.passes.registry import register_attention_op, unregister_attention_op
from kvpp_fx.runtime.runtime import KVPPRuntime
from tests.passes import toy
from tests.support.launch import kvpp_group, launch
from tests.support.specs import TOY_SPECS


def kvpp_run(rank: int, world: int, num_layers: int, mode: str, inner: str) -> dict:
    """Rank function: ToyMLA compiled by kvpp_backend on `world` ranks, through `toy.STEPS`."""
    torch.manual_seed(0)
    group = kvpp_group(world)
    plan = toy.toy_plan(num_layers, group_size=world)
    storage = toy.allocate(plan, dist.get_rank(group))
    backend = kvpp_backend(plan, mode=mode, inner=inner, specs=TOY_SPECS)
    model = torch.compile(toy.ToyMLA(num_layers), backend=backend, fullgraph=True)
    caches = toy.runtime_caches(storage, range(num_layers))
    outs, broadcasts = [], []
    with KVPPRuntime.create(plan, storage, group) as rt, torch.no_grad():
        for step, (seq_len, new) in enumerate(toy.STEPS):
            x, *meta = toy.step_inputs(step, seq_len, new)
            with rt.forward(has_history=step > 0):
                outs.append(model(x, caches, *meta))
            broadcasts.append(rt.last_forward()["broadcasts"])
        stats = rt.stats()
    reference = toy.replicated_run(toy.ToyMLA(num_layers), num_layers)
    return {
        "identical": [torch.equal(a, b) for a, b in zip(outs, reference)],
        "max_diff": [float((a - b).abs().max()) for a, b in zip(outs, reference)],
        "broadcasts": broadcasts,
        "persistent": stats["persistent_layers"],
    }


@pytest.mark.multirank
@pytest.mark.parametrize("mode,inner", [("eager", "eager"), ("piecewise", "aot_eager")])
def test_kvpp_equals_replicated_bit_for_bit(mode, inner):
    results = launch(kvpp_run, 2, 4, mode, inner, timeout_s=180)
    for rank, res in enumerate(results):
        assert all(res["identical"]), (rank, res["max_diff"])
        assert res["broadcasts"] == [0] + [4] * (len(toy.STEPS) - 1)  # none without history
    assert [res["persistent"] for res in results] == [[0, 1], [2, 3]]


def test_full_mode_is_refused_with_the_config_message():
    with pytest.raises(ValueError, match="^KVPP supports eager execution or PIECEWISE only.$"):
        kvpp_backend(toy.toy_plan(4), mode="full")
    with pytest.raises(KVPPBackendError, match="mode must be one of"):
        kvpp_backend(toy.toy_plan(4), mode="fast")


def test_torchair_without_torchair_is_a_named_error():
    with pytest.raises(TorchairNotInstalledError, match="torchair package"):
        kvpp_backend(toy.toy_plan(4), mode="piecewise", inner="torchair")


def test_unknown_inner_backend():
    with pytest.raises(KVPPBackendError, match="unknown inner backend 'nope'"):
        kvpp_backend(toy.toy_plan(4), mode="piecewise", inner="nope")


@pytest.mark.parametrize("inner", ["inductor", "no-such-backend", "aot_eager"])
def test_eager_mode_refuses_any_inner_but_eager(inner):
    with pytest.raises(KVPPBackendError, match=f"mode='eager' .* inner='{inner}' would be ignored"):
        kvpp_backend(toy.toy_plan(4), mode="eager", inner=inner)
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    assert kvpp_backend(toy.toy_plan(4), mode="eager", inner="eager").inner(gm, []) is gm  # resolved when built


def run_once(model, backend_or_name, plan, num_layers=4, options=None):
    storage = toy.allocate(plan)
    caches = toy.runtime_caches(storage, range(num_layers))
    compiled = torch.compile(model, backend=backend_or_name, options=options, fullgraph=True)
    x, *meta = toy.step_inputs(0, 5, 5)
    with KVPPRuntime.create(plan, storage) as rt, rt.forward(has_history=False):
        return compiled(x, caches, *meta)


def test_registered_backend_name_takes_options_or_the_current_runtime(tmp_path):
    plan = toy.toy_plan(4)
    expected = toy.ToyMLA(4)(toy.step_inputs(0, 5, 5)[0], toy.replicated_caches(4), *toy.step_inputs(0, 5, 5)[1:])
    out = run_once(toy.ToyMLA(4), "kvpp", plan, options={"plan": plan, "mode": "piecewise", "dump_dir": str(tmp_path),
                                                          "specs": TOY_SPECS})
    assert torch.equal(out, expected)
    torch._dynamo.reset()
    out = run_once(toy.ToyMLA(4), "kvpp", plan, options={"specs": TOY_SPECS})  # plan from the runtime
    assert torch.equal(out, expected)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown kvpp backend options"):
        run_once(toy.ToyMLA(4), "kvpp", plan, options={"plan": plan, "colour": "red"})


def test_registered_backend_refuses_a_runtime_with_another_plan():
    plan = toy.toy_plan(4)
    other = KVPPPlan(toy.toy_spec(4), group_size=1, depth=3)  # same layers, other slots
    x, *meta = toy.step_inputs(0, 5, 5)
    torch._dynamo.reset()
    compiled = torch.compile(toy.ToyMLA(4), backend="kvpp", options={"specs": TOY_SPECS},
                             fullgraph=True)  # plan from the runtime
    storage = toy.allocate(plan)
    with KVPPRuntime.create(plan, storage) as rt, rt.forward(has_history=False):
        compiled(x, toy.runtime_caches(storage, range(4)), *meta)
    storage = toy.allocate(other)
    with KVPPRuntime.create(other, storage) as rt:
        with pytest.raises(PlanChangedError, match="depth 2.*depth 3"), rt.forward(has_history=False):
            compiled(x, toy.runtime_caches(storage, range(4)), *meta)  # Dynamo reuses the graph: no guard fails


def test_fullgraph_model_whose_attention_is_not_registered_is_refused():
    from kvpp_fx.passes.insert_checks import NoGraphLayersError

    plan = toy.toy_plan(4)
    torch._dynamo.reset()
    compiled = torch.compile(toy.ToyUnregistered(4), backend=kvpp_backend(plan, specs=TOY_SPECS), fullgraph=True)
    x, *meta = toy.step_inputs(0, 5, 5)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as err:
        compiled(x, toy.replicated_caches(4), *meta)
    assert isinstance(err.value.inner_exception, NoGraphLayersError)
    assert "'kvpp_ref::mla_attention'" in str(err.value.inner_exception)


def test_dump_dir_writes_before_after_pieces_and_index(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPP_DUMP_DIR", str(tmp_path))
    plan = toy.toy_plan(4)
    backend = kvpp_backend(plan, mode="piecewise", specs=TOY_SPECS)
    run_once(toy.ToyMLA(4), backend, plan)
    (graph_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    index = json.loads((graph_dir / "index.json").read_text())
    files = [f["file"] for f in index["files"]]
    assert files[:2] == ["before_pass.py", "after_pass.py"]
    assert len(files) == 2 + 10 and sum("_eager_" in f for f in files) == 5
    assert "kvpp.wait" not in (graph_dir / "before_pass.py").read_text()
    assert "torch.ops.kvpp.wait.default(0, 0" in (graph_dir / "after_pass.py").read_text()
    assert index["layers"] == [0, 1, 2, 3]


@pytest.mark.inductor
def test_inductor_pieces_keep_kvpp_calls_in_order():
    plan = toy.toy_plan(2)
    storage = toy.allocate(plan)
    rt = KVPPRuntime.create(plan, storage)
    calls = []
    prefetch, wait = rt.prefetch, rt.wait
    rt.prefetch = lambda layer, slot: (calls.append(f"prefetch({layer},{slot})"), prefetch(layer, slot))[1]
    rt.wait = lambda layer, slot, **kw: (calls.append(f"wait({layer},{slot})"), wait(layer, slot, **kw))[1]
    backend = kvpp_backend(plan, mode="piecewise", inner="inductor", specs=TOY_SPECS)
    model = toy.ToyMLA(2)
    reference = toy.ToyMLA(2)
    x, *meta = toy.step_inputs(0, 5, 5)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with rt, rt.forward(has_history=True):
        out = compiled(x, toy.runtime_caches(storage, range(2)), *meta)
    assert calls == ["prefetch(0,0)", "wait(0,0)", "prefetch(1,1)", "wait(1,1)"]
    torch.testing.assert_close(out, reference(x, toy.replicated_caches(2), *meta))
    compiled_pieces = [p for p in backend.records[-1].pieces if p[1] == "compiled"]
    assert len(compiled_pieces) == 3


def test_a_handle_that_reaches_a_cache_op_is_refused():
    from kvpp_fx.reference.ops import UnboundCacheError

    plan = toy.toy_plan(4)
    storage = toy.allocate(plan)
    x, *meta = toy.step_inputs(0, 5, 5)
    with pytest.raises(UnboundCacheError,
                       match="layer 0: the cache operand is a KVPP cache handle, which holds no bytes"):
        toy.ToyMLA(4)(x, toy.runtime_caches(storage, range(4)), *meta)  # not compiled: nothing rebinds


@contextlib.contextmanager
def registered(specs):
    """`specs` in the default specs (`register_attention_op`) for the duration, then out again."""
    for spec in specs:
        register_attention_op(spec)
    try:
        yield
    finally:
        for spec in specs:
            unregister_attention_op(spec.op)


def test_a_backend_without_the_models_specs_refuses_its_graph():
    plan = toy.toy_plan(4)
    x, *meta = toy.step_inputs(0, 5, 5)
    expected = toy.ToyMLA(4)(x, toy.replicated_caches(4), *meta)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as err:
        run_once(toy.ToyMLA(4), kvpp_backend(plan), plan)  # the default specs: importing the ops added none
    assert isinstance(err.value.inner_exception, StrayCacheReadError)
    assert "kvpp_ref.write_kv" in str(err.value.inner_exception)
    torch._dynamo.reset()
    with registered(TOY_SPECS):  # control: the same defaults once the toy specs are registered
        backend = kvpp_backend(plan)
    assert torch.equal(run_once(toy.ToyMLA(4), backend, plan), expected)


def test_a_spec_registered_after_the_backend_is_built_changes_none_of_its_compiles():
    from tests.passes.test_golden import compile_and_run

    plan = toy.toy_plan(4)
    attention = next(s for s in TOY_SPECS if s.op == "kvpp_ref::mla_attention")
    with registered(TOY_SPECS):
        before = kvpp_backend(plan, mode="eager")  # the default specs, read now
        register_attention_op(dataclasses.replace(attention, owner=None), replace=True)
        after = kvpp_backend(plan, mode="eager")
        assert compile_and_run(toy.ToyMLA(4), before, plan, 4).owner_routed  # insert, route and verify agree
        assert not compile_and_run(toy.ToyMLA(4), after, plan, 4).owner_routed  # control: the new default
    assert before.config != after.config
