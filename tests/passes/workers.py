"""Rank functions for the numerical KVPP-vs-replicated tests of the backend."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvpp_fx.backend import kvpp_backend
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups
from tests.passes import toy

# (seq_len after the step, new tokens): a 6-token prefill, then decode steps that read the cache.
STEPS = [(6, 6), (7, 1), (8, 1), (9, 1), (12, 3), (13, 1)]


def replicated_run(num_layers: int) -> list[torch.Tensor]:
    model = toy.ToyMLA(num_layers)
    caches = toy.replicated_caches(num_layers)
    outs = []
    with torch.no_grad():
        for step, (seq_len, new) in enumerate(STEPS):
            x, *meta = toy.step_inputs(step, seq_len, new)
            outs.append(model(x, caches, *meta))
    return outs


def kvpp_run(rank: int, world: int, num_layers: int, mode: str, inner: str):
    torch.manual_seed(0)
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    plan = toy.toy_plan(num_layers, group_size=world)
    storage = toy.allocate(plan, dist.get_rank(group))
    backend = kvpp_backend(plan, mode=mode, inner=inner)
    model = torch.compile(toy.ToyMLA(num_layers), backend=backend, fullgraph=True)
    caches = toy.runtime_caches(storage, range(num_layers))
    outs = []
    with KVPPRuntime.create(plan, storage, group) as rt, torch.no_grad():
        for step, (seq_len, new) in enumerate(STEPS):
            x, *meta = toy.step_inputs(step, seq_len, new)
            with rt.forward(has_history=step > 0):
                outs.append(model(x, caches, *meta))
        stats = rt.stats()
    reference = replicated_run(num_layers)
    return {
        "identical": [torch.equal(a, b) for a, b in zip(outs, reference)],
        "max_diff": [float((a - b).abs().max()) for a, b in zip(outs, reference)],
        "broadcasts": [f["broadcasts"] for f in stats["forwards"]],
        "persistent": stats["persistent_layers"],
        "compiles": len(backend.records),
    }
