"""What the ranks run: device ordering, overlap and host time, end to end."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.device_check import E2E_GROUP_TIMEOUT, LATE_MS, MEASURE_GROUP_TIMEOUT, STALL_MS
from benchmarks.device_check.seams import (Stall, make_seam_api, probe_collectives, rank_device, synchronize,
                                           use_compute_stream)


# --- ordering ---------------------------------------------------------------------------------------

ORDER_LAYERS, ORDER_BLOCKS, ORDER_BLOCK, ORDER_WIDTH = 8, 64, 16, 64  # 256 KiB per layer, fp32
ORDER_FORWARDS = 3
ACTIVE = [1, 5, 9, 20, 33, 47, 63]  # 7 of 64 blocks: under the crossover, packed
HEADS_PER_RANK, ROPE, SCALE = 2, 8, 0.125


def _order_spec():
    from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
    comps = (ComponentSpec("kv", "float32", (ORDER_WIDTH,)),)
    return ModelCacheSpec("device-check", ORDER_BLOCK, tuple(LayerCacheSpec(i, comps) for i in range(ORDER_LAYERS)))


def _expected(forward: int, layer: int, device: torch.device) -> torch.Tensor:
    """The owner's bytes for (forward, layer): exact in fp32 (all values below 2**24)."""
    numel = ORDER_BLOCKS * ORDER_BLOCK * ORDER_WIDTH
    return (torch.arange(numel, dtype=torch.float32, device=device) + forward * 100_000 + layer * 1_000
            ).view(ORDER_BLOCKS, ORDER_BLOCK, ORDER_WIDTH)


def _fresh_runtime(device: torch.device, api: Any, *, attention: Any = None, timeout: float = 20.0):
    """A runtime over a new group of all ranks, so a control's stray collectives pair with nothing else."""
    from kvpp_fx.cache.allocate import allocate_cache
    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.runtime.runtime import KVPPRuntime

    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=30))
    plan = KVPPPlan(_order_spec(), group_size=dist.get_world_size(group))
    storage = allocate_cache(plan, dist.get_rank(group), ORDER_BLOCKS, device=device)
    return KVPPRuntime.create(plan, storage, group, device_api=api, timeout=timeout, attention=attention)


def _broadcast_forwards(rt: Any, stall: Stall, blocks: list[int] | None) -> list[str]:
    """Forwards in graph order, the compute stream stalled before every ready point, done point and read.

    The owner writes the forward's bytes into its persistent view just before each prefetch; attention's
    read is a copy on the compute stream. Returns every (forward, layer) whose read bytes differ from
    the owner's (only the listed blocks count on receivers when `blocks` is given: packed at the front of
    the slot, in sorted order). A stall before a
    ready point makes a broadcast that does not wait for it send stale bytes; a stall before a read
    makes the next broadcast into that slot, if unordered, overwrite it first.
    """
    from kvpp_fx.schedule import PREFETCH

    plan, me, device = rt.plan, rt.rank, rt.storage.device
    schedule = plan.schedule()
    layers = plan.target_layers
    reads = []

    for f in range(ORDER_FORWARDS):
        def prefetch(layer: int) -> None:
            stall()  # ready point
            if plan.owner(layer) == me:
                rt.typed_views(layer)["kv"].copy_(_expected(f, layer, device))
            rt.prefetch(layer, plan.slot(layer))

        with rt.forward(True, blocks=blocks):
            for layer in layers:
                for step in schedule.entry(layer):
                    if step.kind == PREFETCH:
                        prefetch(step.layer)
                    else:
                        stall()  # done point
                        rt.wait(step.layer, step.slot)
                stall()  # attention reads late: the next broadcast into this slot must wait for it
                reads.append((f, layer, rt.typed_views(layer)["kv"].clone()))
    synchronize(device)
    wrong = []
    for f, layer, got in reads:
        want = _expected(f, layer, device)
        if blocks is not None and plan.owner(layer) != me:  # packed: the listed blocks, in order, in front
            got, want = got[: len(blocks)], want[sorted(blocks)]
        if not torch.equal(got, want):
            wrong.append(f"forward {f} layer {layer}")
    return wrong


def _owner_inputs(rank: int, layer: int, forward: int, device: torch.device):
    gen = torch.Generator().manual_seed(10_000 * forward + 100 * rank + layer)
    q_latent = torch.randn(3, HEADS_PER_RANK, ORDER_WIDTH - ROPE, generator=gen)
    q_pe = torch.randn(3, HEADS_PER_RANK, ROPE, generator=gen)
    return q_latent.to(device), q_pe.to(device)


def _owner_metadata(device: torch.device):
    """Two requests: 40 context tokens (2 new) and 20 (1 new), over blocks of the toy pool."""
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0]], dtype=torch.int32, device=device)
    return table, torch.tensor([40, 20], device=device), torch.tensor([2, 1], device=device)


def _owner_forwards(rt: Any, stall: Stall) -> list[str]:
    """Owner-mode forwards: every rank's queries are produced on the compute stream after a stall and
    exchanged; each rank's part must equal the attention over all heads on the owner's bytes (to fp32
    rounding: the reference is recomputed on this rank).

    The queries are uploaded before the forward and copied on the device inside it: an upload from
    pageable memory would synchronise the host with the stalled stream and hide an early read.
    """
    import kvpp_fx.reference.ops  # noqa: F401  (defines the kvpp_ref ops)
    from kvpp_fx.cache.cost import StepLoad
    from kvpp_fx.runtime.graph_ops import RoutedOp
    from kvpp_fx.schedule import PREFETCH

    attention = torch.ops.kvpp_ref.mla_attention.default
    plan, me, device, world = rt.plan, rt.rank, rt.storage.device, rt.plan.group_size
    schedule = plan.schedule()
    table, seq_lens, query_lens = _owner_metadata(device)
    layers = plan.target_layers
    reads = []
    for f in range(ORDER_FORWARDS):
        uploaded = {layer: _owner_inputs(me, layer, f, device) for layer in layers}
        synchronize(device)
        for layer in plan.owned_layers(me):
            stall()
            rt.typed_views(layer)["kv"].copy_(_expected(f, layer, device))
        with rt.forward(True, mode="owner", load=StepLoad(3, 3 * 40)):
            for layer in layers:
                for step in schedule.entry(layer):
                    if step.kind == PREFETCH:
                        rt.prefetch(step.layer, step.slot)
                    else:
                        rt.wait(step.layer, step.slot, routed=True)
                stall()  # the queries are late: the gather must not read them early
                q_latent, q_pe = (t.clone() for t in uploaded[layer])
                out = RoutedOp(attention, layer, ((0, 1), (1, 1)), 1)(
                    q_latent, q_pe, rt.typed_views(layer)["kv"], table, seq_lens, query_lens, SCALE, layer)
                reads.append((f, layer, out.clone()))
    synchronize(device)
    wrong = []
    for f, layer, got in reads:
        parts = [_owner_inputs(r, layer, f, device) for r in range(world)]
        full = attention(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1),
                         _expected(f, layer, device), table, seq_lens, query_lens, SCALE, layer)
        # device GEMMs need not be bit-reproducible across calls: a tolerance far below what an early read gives
        if not torch.allclose(got, full[:, me * HEADS_PER_RANK:(me + 1) * HEADS_PER_RANK], rtol=1e-5, atol=1e-6):
            wrong.append(f"forward {f} layer {layer}")
    return wrong


# name, seam options, driver, active blocks, compute stalls, a negative control (must be caught).
# With a late link the compute stream runs unstalled: attention then reads as early as the host lets it,
# and only the done event keeps it behind the bytes that land LATE_MS after the work completed.
ORDER_SCENARIOS = (
    ("whole layers", {}, "broadcast", None, True, False),
    ("active blocks", {}, "broadcast", ACTIVE, True, False),
    ("late link, whole layers", {"late_ms": LATE_MS}, "broadcast", None, False, False),
    ("late link, active blocks", {"late_ms": LATE_MS}, "broadcast", ACTIVE, False, False),
    ("owner mode exchanges", {}, "owner", None, True, False),
    ("control: transfer stream skips ready", {"drop": "ready"}, "broadcast", None, True, True),
    ("control: compute stream skips done", {"drop": "done", "late_ms": LATE_MS}, "broadcast", None, False, True),
    ("control: exchanges skip Work.wait()", {"drop": "work"}, "owner", None, False, True),
)


def ordering_worker(rank: int, world: int, device_type: str) -> dict[str, Any]:
    from kvpp_fx.cache.cost import AttentionShape

    device = rank_device(device_type)
    use_compute_stream(device)
    stall = Stall(device)
    probes = probe_collectives(device)
    owner_ok = probes["gather"] == "ok" and probes["scatter"] == "ok"
    shape = AttentionShape(HEADS_PER_RANK * world, ORDER_WIDTH, ORDER_WIDTH - ROPE, 4)
    out = {"probes": probes, "cycles_per_ms": stall.cycles_per_ms, "stall_ms": STALL_MS, "late_ms": LATE_MS,
           "scenarios": {}}
    for name, seam, driver, blocks, stalls, control in ORDER_SCENARIOS:
        if driver == "owner" and not owner_ok:
            out["scenarios"][name] = {"skipped": f"gloo gather/scatter on {device.type} tensors: "
                                                 f"{probes['gather']}; {probes['scatter']}"}
            continue
        # a control is meant to break the runtime: its logged break is no news
        logging.getLogger("kvpp_fx").setLevel(logging.CRITICAL if control else logging.NOTSET)
        api = make_seam_api(device, stall=stall, **seam)
        # a control may leave a peer waiting for a collective that never comes: a short timeout bounds it
        rt = _fresh_runtime(device, api, attention=shape, timeout=5.0 if control else 20.0)
        record: dict[str, Any] = {"control": control}
        compute_stall = stall if stalls else (lambda ms=0.0: None)
        try:
            wrong = (_owner_forwards(rt, compute_stall) if driver == "owner"
                     else _broadcast_forwards(rt, compute_stall, blocks))
            record.update(wrong=wrong[:8], n_wrong=len(wrong))
        except Exception as exc:  # a control may also be caught by the runtime itself
            record.update(error=_one_line(exc), n_wrong=None)
        record["dropped_waits"] = api.dropped
        synchronize(device)
        if control:
            time.sleep(0.2)  # let a control's unwaited collectives land before the group goes away
        with contextlib.suppress(Exception):
            rt.close()
        dist.barrier()
        out["scenarios"][name] = record
    return out


# --- overlap and host time -----------------------------------------------------------------------------

def _overlap_runtime(device: torch.device, layers: int, layer_mib: int):
    from kvpp_fx.cache.allocate import allocate_cache
    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
    from kvpp_fx.runtime.runtime import KVPPRuntime

    block, width = 16, 1024  # fp32: 64 KiB per block
    comps = (ComponentSpec("kv", "float32", (width,)),)
    plan = KVPPPlan(ModelCacheSpec("overlap", block, tuple(LayerCacheSpec(i, comps) for i in range(layers))),
                    group_size=dist.get_world_size())
    group = dist.new_group(list(range(dist.get_world_size())), timeout=MEASURE_GROUP_TIMEOUT)
    blocks = layer_mib * 2**20 // (block * width * 4)
    return KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), blocks, device=device), group)


class Matmuls:
    """Real compute on the current stream: `n` square matmuls (bf16 on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        size, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (192, torch.float32)
        self.a = torch.randn(size, size, device=device, dtype=dtype)
        self.b = torch.randn(size, size, device=device, dtype=dtype)
        self.c = torch.empty_like(self.a)

    def __call__(self, n: int) -> None:
        for _ in range(n):
            torch.mm(self.a, self.b, out=self.c)


def _timed(device: torch.device, fn) -> float:
    """Seconds from a barrier to the end of `fn`'s device work, both ranks at once."""
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _overlap_forward(rt: Any, compute: Matmuls, n: int, overlapped: bool) -> None:
    """benchmarks/overlap.py's two orders: compute then prefetch+wait (serial), or the graph's order."""
    schedule = rt.plan.schedule()
    with rt.forward(has_history=True):
        if overlapped:
            first = schedule.first()
            rt.prefetch(first.layer, first.slot)
        for layer in schedule.target_layers:
            compute(n)
            if overlapped:
                for step in schedule.at_layer(layer):
                    getattr(rt, step.kind)(step.layer, step.slot)
            else:
                rt.prefetch(layer, schedule.slot(layer))
                rt.wait(layer, schedule.slot(layer))


def _overlap(device: torch.device, layers: int, layer_mib: int, repeats: int) -> dict[str, Any]:
    rt = _overlap_runtime(device, layers, layer_mib)
    compute = Matmuls(device)
    _timed(device, lambda: _overlap_forward(rt, compute, 1, False))  # warm-up: connections, kernels
    transfer = [_timed(device, lambda: _overlap_forward(rt, compute, 0, False)) for _ in range(repeats)]
    per_mm = _timed(device, lambda: compute(20)) / 20
    n = int(max(_gather_floats([max(1, math.ceil(1.2 * statistics.median(transfer) / layers / per_mm))])))
    serial, overlapped, compute_only = [], [], []
    for _ in range(repeats):
        serial.append(_timed(device, lambda: _overlap_forward(rt, compute, n, False)))
        overlapped.append(_timed(device, lambda: _overlap_forward(rt, compute, n, True)))
        compute_only.append(_timed(device, lambda: compute(n * layers)))
    rt.close()
    med = {k: statistics.median(v) for k, v in (("transfer", transfer), ("serial", serial),
                                                ("overlapped", overlapped), ("compute", compute_only))}
    return {"layers": layers, "layer_bytes": layer_mib * 2**20, "matmuls_per_layer": n,
            "median_s": med, "raw_s": {"transfer": transfer, "serial": serial, "overlapped": overlapped,
                                       "compute": compute_only},
            "hidden_fraction": (med["serial"] - med["overlapped"]) / med["transfer"],
            "hidden_fraction_vs_compute": 1.0 - (med["overlapped"] - med["compute"]) / med["transfer"]}


def _gather_floats(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return [v for t in out for v in t.tolist()]


def _host_time(device: torch.device, layers: int, forwards: int) -> dict[str, Any]:
    """benchmarks/runtime_overhead.py on this device: the runtime's own host work per layer."""
    from runtime_overhead import NoOpTransportAPI, _calls, _forward

    from kvpp_fx.cache.allocate import allocate_cache
    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
    from kvpp_fx.runtime.runtime import KVPPRuntime

    comps = (ComponentSpec("kv", "bfloat16", (576,)),)
    plan = KVPPPlan(ModelCacheSpec("bench", 16, tuple(LayerCacheSpec(i, comps) for i in range(layers))),
                    group_size=dist.get_world_size())
    group = dist.new_group(list(range(dist.get_world_size())), timeout=MEASURE_GROUP_TIMEOUT)
    # the agreement on a host-side group, as in the CPU figure's run: on the device's group it would add two
    # synchronising copies per forward to a per-layer figure
    rt = KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), 4, device=device), group,
                            device_api=NoOpTransportAPI(device), agreement_group=group)
    calls = _calls(rt)  # bound once, as a compiled graph holds them and as the CPU figure's run does
    for _ in range(30):
        _forward(rt, True, calls)
    synchronize(device)
    with_history = [_forward(rt, True, calls) / layers * 1e6 for _ in range(forwards)]
    without = [_forward(rt, False, calls) / layers * 1e6 for _ in range(forwards)]
    synchronize(device)
    rt.close()
    return {"layers": layers, "forwards": forwards, "us_per_layer_with_history": statistics.median(with_history),
            "us_per_layer_without_history": statistics.median(without)}


def _sync_counts(device: torch.device) -> dict[str, Any]:
    """CUDA synchronisations the runtime makes on the forward's thread, per layer and per forward, over
    real gloo broadcasts (the agreement on a host-side group, as the vLLM integration runs it)."""
    from kvpp_fx.cache.allocate import allocate_cache
    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.runtime.runtime import KVPPRuntime

    world = list(range(dist.get_world_size()))
    group = dist.new_group(world, timeout=MEASURE_GROUP_TIMEOUT)
    agreement = dist.new_group(world, backend="gloo", timeout=MEASURE_GROUP_TIMEOUT)
    plan = KVPPPlan(_order_spec(), group_size=len(world))
    rt = KVPPRuntime.create(plan, allocate_cache(plan, dist.get_rank(group), ORDER_BLOCKS, device=device), group,
                            agreement_group=agreement)
    counts = {}
    for path, blocks in (("whole layers", None), ("active blocks", ACTIVE)):
        for _ in range(2):  # warm-up: the first forward allocates
            _count_forward(rt, blocks)
        synchronize(device)
        dist.barrier()
        counts[path] = _count_forward(rt, blocks)
        synchronize(device)
    rt.close()
    return counts


def _count_forward(rt: Any, blocks: list[int] | None) -> dict[str, int]:
    plan = rt.plan
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, _quiet_stderr():
            warnings.simplefilter("always")
            with rt.forward(True, blocks=blocks):
                entered = _syncs(caught)
                plan.schedule().run(rt)
                in_layers = _syncs(caught) - entered
            total = _syncs(caught)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"per_forward": total, "in_layers": in_layers, "layers": len(plan.target_layers)}


def _syncs(caught: list) -> int:
    return sum("synchroniz" in str(w.message) for w in caught)


@contextlib.contextmanager
def _quiet_stderr():
    """gloo's own threads synchronise too (the CUDA copies of gloo over CUDA) and warn on file
    descriptor 2; those are not the runtime's and would flood the summary."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def overlap_worker(rank: int, world: int, device_type: str, smoke: bool) -> dict[str, Any]:
    device = rank_device(device_type)
    use_compute_stream(device)
    out: dict[str, Any] = {}
    layers, layer_mib, repeats = (4, 1, 2) if smoke else (8, 16, 5)
    out["overlap"] = _overlap(device, layers, layer_mib, repeats)
    out["host_time"] = _host_time(device, 61, 60 if smoke else 300)
    if device.type == "cuda":
        out["syncs"] = _sync_counts(device)
    return out


# --- end to end ---------------------------------------------------------------------------------------

E2E_PRESET, E2E_NEW_TOKENS, E2E_BUDGET = "tiny", 10, 24


def _device_engine_class():
    from kvpp_fx.reference.engine import BlockPool, Engine

    class DeviceEngine(Engine):
        """The reference engine with its step inputs on the cache's device.

        `Engine._inputs` builds CPU tensors and `build_engine` allocates on the CPU; this subclass and
        `build_device_engine` are what the reference stack lacks to run on a device.
        """

        def _inputs(self, batch):
            device = self.runtime.storage.device
            return {name: tensor.to(device) for name, tensor in super()._inputs(batch).items()}

        def restart(self, kvpp_mode: str) -> None:
            """A new workload on the same compiled model and runtime: empty pool, zeroed cache."""
            self.pool = BlockPool(self.runtime.storage.num_blocks, self.config.block_size)
            self.requests, self.steps, self.last_logits = [], [], None
            self.kvpp_mode = kvpp_mode
            storage = self.runtime.storage
            for buffer in (*storage.persistent.values(), *storage.scratch):
                buffer.zero_()

    return DeviceEngine


def build_device_engine(config: Any, engine_config: Any, num_blocks: int, kvpp: bool, tp: Any, group: Any,
                        device: torch.device) -> Any:
    """`kvpp_fx.reference.engine.build_engine` with the model and the cache on `device`."""
    from kvpp_fx.cache.allocate import allocate_cache
    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.reference.weights import build_model
    from kvpp_fx.runtime.runtime import KVPPRuntime

    model = build_model(config, tp).to(device)
    plan = KVPPPlan(config.cache_spec(engine_config.block_size), group_size=tp.size if kvpp else 1,
                    layers=model.layer_ids)
    group = group if plan.enabled else None
    rank = dist.get_rank(group) if group is not None else 0
    storage = allocate_cache(plan, rank, num_blocks, device=device)
    runtime = KVPPRuntime.create(plan, storage, group, attention=config.attention_shape() if plan.enabled else None,
                                 link=engine_config.kvpp_link)
    return _device_engine_class()(model, runtime, engine_config)


def _run_workload(engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    for prompt in prompts:
        engine.add_request(prompt, E2E_NEW_TOKENS)
    logits, start = [], time.perf_counter()
    with torch.no_grad():
        while not all(r.finished for r in engine.requests):
            engine.step()
            logits.append(engine.last_logits.detach().float().cpu())
    return {"outputs": [r.output for r in engine.requests], "logits": logits, "steps": engine.steps,
            "seconds": time.perf_counter() - start}


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float | None:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    return max((float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def end_to_end_worker(rank: int, world: int, device_type: str, inner: str) -> dict[str, Any]:
    """KVPP off, then KVPP on in each mode on one compiled graph. A mode that raises is recorded and the
    next one gets a new engine on new groups (a forward that raised broke its runtime)."""
    from kvpp_fx.cache.cost import LinkModel
    from kvpp_fx.reference.config import PRESETS
    from kvpp_fx.reference.engine import EngineConfig
    from kvpp_fx.reference.generate import default_num_blocks
    from kvpp_fx.reference.model import TPInfo
    from kvpp_fx.reference.workload import shared_prefix_prompts
    from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

    device = rank_device(device_type)
    probes = probe_collectives(device)
    modes = ["broadcast"]
    if probes["gather"] == "ok" and probes["scatter"] == "ok":
        modes += ["owner", "auto"]
    config = PRESETS[E2E_PRESET]
    prompts = shared_prefix_prompts(config.vocab_size)
    num_blocks = max(64, default_num_blocks(prompts, E2E_NEW_TOKENS, 16))
    # A slow link (as in tests/reference/test_owner_mode.py): auto broadcasts the prefill chunks and sends
    # the decode steps to the owners, so one run shows both choices.
    engine_config = EngineConfig(graph_mode="piecewise", inner=inner, token_budget=E2E_BUDGET, active_blocks=True,
                                 kvpp_link=LinkModel(bytes_per_s=1e9, latency_s=5e-6))

    def engine(kvpp: bool) -> Any:
        groups = kvpp_groups(world, tp=world)
        tp = TPInfo(rank, world, create_kvpp_process_groups(groups, timeout=E2E_GROUP_TIMEOUT))
        return build_device_engine(config, engine_config, num_blocks, kvpp, tp,
                                   create_kvpp_process_groups(groups, timeout=E2E_GROUP_TIMEOUT), device)

    out: dict[str, Any] = {"probes": probes, "modes": modes, "runs": {}}
    start = time.perf_counter()
    off = engine(False)
    reference = _run_workload(off, prompts)
    off.runtime.close()
    out["off_seconds"] = time.perf_counter() - start
    out["off"] = {"outputs": reference["outputs"], "steps": len(reference["steps"])}
    on = None
    for mode in modes:  # one compiled graph serves every mode
        if on is None:
            torch._dynamo.reset()
            on = engine(True)
        on.restart(mode)
        try:
            run = _run_workload(on, prompts)
        except Exception as exc:
            out["runs"][mode] = {"error": _one_line(exc), "steps_done": len(on.steps)}
            with contextlib.suppress(Exception):
                on.runtime.close()
            on = None
            dist.barrier()
            continue
        steps = run["steps"]
        out["runs"][mode] = {
            "outputs": run["outputs"], "identical": run["outputs"] == reference["outputs"],
            "max_logit_diff": _max_diff(run["logits"], reference["logits"]), "seconds": run["seconds"],
            "step_modes": [s["mode"] for s in steps], "decode_only": [s["decode_only"] for s in steps],
            "active_steps": sum(1 for s in steps if s["active_blocks"]),
            "broadcast_bytes": sum(s["broadcast_bytes"] for s in steps),
            "owner_bytes": sum(s["owner_bytes"] for s in steps)}
    if on is not None:
        on.runtime.close()
    return out


def _one_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message (inductor's add a paragraph of advice)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"




# --- owner calls on vLLM's GPU MLA kernels -----------------------------------------------------------------

OWNER_KERNEL_SHAPE = {"heads_per_rank": 16, "group": 8, "batch": 4, "blocks": 64, "block_size": 64}


def owner_kernels_worker(rank: int, world: int, device_type: str) -> dict[str, Any]:
    """One rank (the others idle): vLLM's own ``forward_mqa`` of TRITON_MLA and FLASHMLA (bf16, and fp8 with
    fp8 queries) on the device, an owner call over a group's heads (DeepSeek-V3 under TP 8: 16 heads per
    rank, 8 ranks) against each rank's own call, as KVPP runs it (`backends.owner_call`,
    `backends.owner_metadata`); for FLASHMLA (bf16) the control too: vLLM's one scheduling metadata for both
    head counts. Needs vLLM on the machine."""
    if rank != 0:
        return {}
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vLLM is not installed on this machine (the device check carries no vLLM wheel)"}
    if device_type != "cuda":
        return {"skipped": "vLLM's GPU MLA kernels need a GPU (make test runs TRITON_MLA's under Triton's "
                           "interpreter on CPU)"}
    out = {}
    for backend in ("TRITON_MLA", "FLASHMLA", "FLASHMLA_FP8"):
        try:
            out[backend] = _owner_kernel(backend, torch.device("cuda", 0))
        except Exception as exc:  # a kernel that does not import or run here is named, not hidden
            out[backend] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return out


def _owner_kernel(backend: str, device: torch.device) -> dict[str, Any]:
    import dataclasses
    import types

    from kvpp_fx.integrations.vllm.attention.backends import owner_call, owner_metadata

    s = OWNER_KERNEL_SHAPE
    h, g, b, block = s["heads_per_rank"], s["group"], s["batch"], s["block_size"]
    fp8, backend = backend.endswith("_FP8"), backend.removesuffix("_FP8")
    torch.manual_seed(0)
    cache = torch.randn(s["blocks"], block, 576, device=device, dtype=torch.bfloat16)
    table = torch.randperm(s["blocks"], device=device, dtype=torch.int32)[: b * 8].view(b, 8)
    seq_lens = torch.tensor([block * 8 - 5, 100, 257, 33][:b], device=device, dtype=torch.int32)
    queries = [torch.randn(b, h, 576, device=device, dtype=torch.bfloat16) for _ in range(g)]
    layer = types.SimpleNamespace(_k_scale=torch.ones((), device=device), _q_scale=torch.ones((), device=device))
    if fp8:  # as vLLM quantizes an fp8 cache's rows and (static per-tensor scales) its absorbed queries
        layer = types.SimpleNamespace(_k_scale=torch.tensor(0.05, device=device),
                                      _q_scale=torch.tensor(0.02, device=device))
        cache = (cache.float() / layer._k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        queries = [(q.float() / layer._q_scale).clamp(-448, 448).to(torch.float8_e4m3fn) for q in queries]
    if backend == "TRITON_MLA":
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl as Impl

        impl = types.SimpleNamespace(kv_lora_rank=512, scale=0.07, dcp_world_size=1,
                                     _sm_count=current_platform.num_compute_units())

        def metadata():
            decode = types.SimpleNamespace(block_table=table, seq_lens=seq_lens)
            return types.SimpleNamespace(decode=decode, max_seq_len=int(seq_lens.max()), causal=True)
    else:
        from vllm.v1.attention.backends.mla.flashmla import FlashMLADecodeMetadata, FlashMLAImpl as Impl
        from vllm.v1.attention.ops.flashmla import FlashMLASchedMeta, get_mla_metadata_dense_fp8

        impl = types.SimpleNamespace(kv_lora_rank=512, scale=0.07, kv_cache_dtype="fp8" if fp8 else "auto",
                                     need_to_return_lse_for_decode=False)

        @dataclasses.dataclass
        class Metadata:  # FlashMLAMetadata, less the common fields its forward_mqa does not read
            decode: FlashMLADecodeMetadata
            num_decodes: int
            num_decode_tokens: int

        def metadata():  # as FlashMLAMetadataBuilder builds a step's, for the rank's heads
            scheduling = FlashMLASchedMeta()
            if fp8:
                scheduling.tile_scheduler_metadata, scheduling.num_splits = get_mla_metadata_dense_fp8(
                    seq_lens, h, 1)
            decode = FlashMLADecodeMetadata(block_table=table, seq_lens=seq_lens, dcp_tot_seq_lens=None,
                                            scheduler_metadata=scheduling)
            return Metadata(decode, b, b)

    def forward_mqa(q, md):
        return Impl.forward_mqa(impl, q, cache, md, layer)[0]

    step = metadata()  # one step: the ranks' own calls and the owner call share vLLM's metadata object
    own = [forward_mqa(q, step).float() for q in queries]
    owner_md = owner_metadata(backend, step, h * g, fp8)
    full = owner_call(backend, forward_mqa, torch.cat(queries, dim=1), owner_md, h).float()
    diff = max(float((part - mine).abs().max()) for part, mine in zip(full.split(h, dim=1), own))
    result = {"max_abs_diff": diff, "heads": [h, h * g], "owner_metadata_own": owner_md is not step}
    if backend == "FLASHMLA" and not fp8:  # the control: vLLM's one metadata object for both head counts
        shared = metadata()
        forward_mqa(queries[0], shared)
        try:
            forward_mqa(torch.cat(queries, dim=1), shared)
            result["shared_metadata"] = "ran"
        except Exception as exc:
            result["shared_metadata"] = f"{type(exc).__name__}"
    return result
