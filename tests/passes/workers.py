"""Rank functions for the numerical KVPP-vs-replicated tests of the backend."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvpp_fx.backend import kvpp_backend
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups
from tests.faults import DroppedBroadcast
from tests.passes import toy

# (seq_len after the step, new tokens): a 6-token prefill, then decode steps that read the cache.
STEPS = [(6, 6), (7, 1), (8, 1), (9, 1), (12, 3), (13, 1)]


def last_forward_broadcasts(runtime) -> int:
    return runtime.last_forward()["broadcasts"]


def replicated_run(num_layers: int) -> list[torch.Tensor]:
    return replicated_run_of(toy.ToyMLA(num_layers), num_layers)


def kvpp_run(rank: int, world: int, num_layers: int, mode: str, inner: str):
    torch.manual_seed(0)
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    plan = toy.toy_plan(num_layers, group_size=world)
    storage = toy.allocate(plan, dist.get_rank(group))
    backend = kvpp_backend(plan, mode=mode, inner=inner)
    model = torch.compile(toy.ToyMLA(num_layers), backend=backend, fullgraph=True)
    caches = toy.runtime_caches(storage, range(num_layers))
    outs, broadcasts = [], []
    with KVPPRuntime.create(plan, storage, group) as rt, torch.no_grad():
        for step, (seq_len, new) in enumerate(STEPS):
            x, *meta = toy.step_inputs(step, seq_len, new)
            with rt.forward(has_history=step > 0):
                outs.append(model(x, caches, *meta))
            broadcasts.append(last_forward_broadcasts(rt))
        stats = rt.stats()
    reference = replicated_run(num_layers)
    return {
        "identical": [torch.equal(a, b) for a, b in zip(outs, reference)],
        "max_diff": [float((a - b).abs().max()) for a, b in zip(outs, reference)],
        "broadcasts": broadcasts,
        "persistent": stats["persistent_layers"],
        "compiles": len(backend.records),
    }


def replicated_run_of(model: torch.nn.Module, num_layers: int) -> list[torch.Tensor]:
    """The uncompiled model over real replicated caches: the reference."""
    caches = toy.replicated_caches(num_layers)
    outs = []
    with torch.no_grad():
        for step, (seq_len, new) in enumerate(STEPS):
            x, *meta = toy.step_inputs(step, seq_len, new)
            outs.append(model(x, caches, *meta))
    return outs


def graph_break_run(rank: int, world: int, cases: list[tuple[str, str, bool]]):
    """For each (where, mode, fault): ToyMLAWithBreak compiled by kvpp_backend (Dynamo splits it at the
    break), on `world` ranks, against the uncompiled model over replicated caches."""
    import kvpp_fx.ops as ops

    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
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
        backend = kvpp_backend(plan, mode=mode, inner="aot_eager" if mode == "piecewise" else "eager")
        model = torch.compile(toy.ToyMLAWithBreak(where), backend=backend)
        caches = toy.runtime_caches(storage, range(num_layers))
        real_current_runtime = ops.current_runtime
        outs, broadcasts = [], []
        try:
            with KVPPRuntime.create(plan, storage, group) as rt, torch.no_grad():
                if fault:
                    faulty = DroppedBroadcast(rt, layer=3)
                    ops.current_runtime = lambda: faulty
                for step, (seq_len, new) in enumerate(STEPS):
                    x, *meta = toy.step_inputs(step, seq_len, new)
                    with rt.forward(has_history=step > 0):
                        outs.append(model(x, caches, *meta))
                    broadcasts.append(last_forward_broadcasts(rt))
        finally:
            ops.current_runtime = real_current_runtime
        reference = replicated_run_of(toy.ToyMLAWithBreak(where), num_layers)
        results.append({
            "case": (where, mode, fault),
            "identical": [torch.equal(a, b) for a, b in zip(outs, reference)],
            "graph_layers": [list(r.layers) for r in backend.records],
            "broadcasts": broadcasts,
        })
    return results
