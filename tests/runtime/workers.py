"""Rank functions for the multi-rank runtime tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.runtime import errors as E
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

WIDTH, BLOCK, BLOCKS = 8, 4, 16


def toy_spec(num_layers: int) -> ModelCacheSpec:
    comps = (ComponentSpec("kv", "float32", (WIDTH,)),)
    return ModelCacheSpec("toy", BLOCK, tuple(LayerCacheSpec(i, comps) for i in range(num_layers)))


def build_runtime(rank: int, world: int, tp: int, pp: int, num_layers: int, *, delay=None,
                  pg_timeout_s: float = 20.0):
    groups = kvpp_groups(world, tp=tp, pp=pp)
    group = create_kvpp_process_groups(groups, timeout=timedelta(seconds=pg_timeout_s))
    stage = rank // tp
    per_stage = num_layers // pp
    plan = KVPPPlan(toy_spec(num_layers), group_size=tp,
                    layers=tuple(range(stage * per_stage, (stage + 1) * per_stage)))
    storage = allocate_cache(plan, dist.get_rank(group), BLOCKS)
    return KVPPRuntime.create(plan, storage, group, delay=delay)


def pattern(forward: int, layer: int) -> torch.Tensor:
    return (torch.arange(BLOCKS * BLOCK * WIDTH, dtype=torch.float32) + forward * 10_000 + layer * 100
            ).view(BLOCKS, BLOCK, WIDTH)


def run_layers(rt: KVPPRuntime, on_wait) -> None:
    """Issue the ops exactly as the rewritten graph does: prefetch(first), then wait(L); prefetch(next)."""
    layers = rt.plan.target_layers
    rt.prefetch(layers[0], rt.plan.slot(layers[0]))
    for layer in layers:
        view = rt.wait(layer, rt.plan.slot(layer))
        nxt = rt.plan.next_target(layer)
        if nxt is not None:
            rt.prefetch(nxt, rt.plan.slot(nxt))
        on_wait(layer, view)


def correctness_worker(rank: int, world: int, tp: int, pp: int, num_layers: int, forwards: int):
    rt = build_runtime(rank, world, tp, pp, num_layers)
    me = rt.rank
    mismatches = []
    for f in range(forwards):
        has_history = f % 3 != 0
        for layer in rt.plan.owned_layers(me):
            rt.typed_views(layer)["kv"].copy_(pattern(f, layer))

        def check(layer, view):
            typed = rt.typed_views(layer)["kv"]
            assert typed.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
            if has_history or rt.plan.owner(layer) == me:
                if not torch.equal(typed, pattern(f, layer)):
                    mismatches.append((f, layer))

        with rt.forward(has_history):
            run_layers(rt, check)
    stats = rt.stats()
    rt.close()
    return {"mismatches": mismatches, "stats": stats, "layers": list(rt.plan.target_layers),
            "owned": list(rt.plan.owned_layers(me))}


def race_worker(rank: int, world: int, forwards: int):
    """Decode-like steps under random 0-20 ms transfer delays; each wait's view is checked, written, re-checked."""
    rng = torch.Generator().manual_seed(1234)  # same on every rank: all ranks compute identical KV
    delay_rng = __import__("random").Random(rank)
    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=6,
                       delay=lambda layer: delay_rng.uniform(0.0, 0.020))
    me = rt.rank
    reference = {layer: torch.zeros(BLOCKS, BLOCK, WIDTH) for layer in rt.plan.target_layers}
    early = []
    for step in range(forwards):
        new_tokens = {layer: torch.randn(WIDTH, generator=rng) for layer in rt.plan.target_layers}
        block, offset = divmod(step, BLOCK)

        def attend(layer, view):
            kv = rt.typed_views(layer)["kv"]
            if step > 0 and not torch.equal(kv, reference[layer]):
                early.append(("before-write", step, layer))
            kv[block, offset] = new_tokens[layer]         # the cache write of this step's token
            reference[layer][block, offset] = new_tokens[layer]
            time.sleep(0.001)                             # attention reads while the next layer streams in
            if not torch.equal(kv, reference[layer]):
                early.append(("after-write", step, layer))

        with rt.forward(has_history=step > 0):
            run_layers(rt, attend)
    final_ok = all(torch.equal(rt.typed_views(layer)["kv"], reference[layer]) for layer in rt.plan.owned_layers(me))
    stats = rt.stats()
    rt.close()
    return {"early": early, "final_ok": final_ok, "broadcasts": stats["broadcasts"]}


def dying_worker(rank: int, world: int, victim: int, pg_timeout_s: float):
    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=8, pg_timeout_s=pg_timeout_s)
    with rt.forward(has_history=True):
        run_layers(rt, lambda layer, view: None)
    start = time.monotonic()
    try:
        with rt.forward(has_history=True):
            def maybe_die(layer, view):
                if rank == victim and layer == 2:
                    os._exit(17)
            run_layers(rt, maybe_die)
    except E.TransferFailedError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def failing_transfer_worker(rank: int, world: int):
    def delay(layer):
        if layer == 2:
            raise OSError("injected transfer failure")
        return 0.0

    rt = build_runtime(rank, world, tp=world, pp=1, num_layers=4, delay=delay)
    seen = []
    try:
        with rt.forward(has_history=True):
            rt.prefetch(0, 0)
            rt.wait(0, 0)
            rt.prefetch(1, 1)
            rt.wait(1, 1)
            rt.prefetch(2, 0)
            try:
                rt.wait(2, 0)
            except E.TransferFailedError as exc:
                seen.append(("wait", type(exc).__name__, str(exc), type(exc.__cause__).__name__))
            try:
                rt.prefetch(3, 1)
            except E.ForwardClosedError as exc:
                seen.append(("prefetch", type(exc).__name__, str(exc)))
    except Exception as exc:  # the forward must not mask anything at exit
        seen.append(("exit", type(exc).__name__, str(exc)))
    # a later forward without history still works: nothing was left in flight
    with rt.forward(has_history=False):
        run_layers(rt, lambda layer, view: None)
    rt.close()
    return seen
