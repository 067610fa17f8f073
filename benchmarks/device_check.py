"""The CUDA path in one prepared run: device ordering, end to end, overlap and host time on a real GPU.

    make device-check                        # CUDA when torch sees a GPU, else a smoke pass on CPU
    python benchmarks/device_check.py [--out PATH] [--wheels .device-wheels] [--budget-s 480] [--only NAMES]
                                      [--cpu] [--inner BACKEND]

Two ranks run on one GPU (``cuda:0``) over gloo with CUDA tensors (NCCL refuses two ranks on one
device), with real streams and events. The checks (docs/device-check.md says what they prove and what
they do not):

- ``ordering``: the runtime driven as a rewritten graph drives it, with the compute stream stalled
  (``torch.cuda._sleep``) before every ready point (the owner's write into its persistent view, then
  ``prefetch``), every done point (``wait``) and every attention read. Every byte attention reads, read
  on the compute stream, must be the owner's: whole layers, active blocks, a link whose bytes land late,
  and owner mode's exchanges. Negative controls drop one wait through a `DeviceAPI` seam (the transfer
  stream's wait on ``ready``, the compute stream's wait on ``done``, ``Work.wait()`` of the exchanges)
  and must be caught.
- ``end_to_end``: the reference engine at TP 2 on the device, PIECEWISE with inductor, KVPP in
  broadcast, owner and auto mode with active blocks: greedy tokens identical to KVPP off.
- ``overlap``: the fraction of the transfer hidden behind real GPU compute (matmuls).
- ``host_time``: the runtime's host time per layer with CUDA streams (the CPU benchmark's no-op
  transport), beside the CPU figure, and the CUDA synchronisations the runtime makes per layer.

Every check prints one line, ``device-check <name>: PASS|FAIL|SKIP <figure or reason>``, and the JSON
goes to ``benchmarks/results/device_check.json`` on a GPU, or to a temporary file on the CPU smoke pass
(which never overwrites a GPU result). On a GPU the exit code is 1 when a check fails. Without a GPU
the same code runs on CPU, where streams and events do nothing: the smoke pass says what it could not
run and exits 0 unless a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

# The device machine's torch may lack numpy, which it only needs for what this script does not do; every
# spawned rank would warn about it at import.
os.environ.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # the working tree's kvpp_fx, whatever is installed
    sys.path.insert(1, str(ROOT))

GPU_RESULT = HERE / "results" / "device_check.json"
SMOKE_RESULT = Path(tempfile.gettempdir()) / "kvpp-device-check-smoke.json"
CPU_OVERHEAD = HERE / "results" / "runtime_overhead.json"
CHECKS = ("ordering", "overlap", "host_time", "end_to_end")
WORLD = 2
STALL_MS = 5.0  # far above a small gloo transfer (~0.1-0.3 ms), so an unordered access shows every time
LATE_MS = 20.0  # how late a slow link's bytes land: far above a compute step that does not wait for them
OVERLAP_GOAL = 0.90
# `dist.new_group` without a timeout gets torch's 30 minutes, not the world's: every group here names its own
MEASURE_GROUP_TIMEOUT = timedelta(seconds=60)
E2E_GROUP_TIMEOUT = timedelta(seconds=120)  # below the world's 180 s, so a stuck peer times out before the barrier
REQUIRED_MODULES = ("pydantic",)  # what kvpp_fx imports beyond torch (config.py)


# --- environment ------------------------------------------------------------------------------------

def use_wheels(folder: Path) -> list[str]:
    """Make the packages of `folder`'s wheels importable when this interpreter lacks them.

    The device machine has no network: `make device-wheels` downloads the wheels here and they travel
    with the tree. They are unpacked once into a temporary folder put first on ``sys.path`` (spawned
    ranks inherit it). Returns the modules that were missing.
    """
    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not missing or not wheels:
        return missing
    digest = hashlib.sha1("".join(w.name for w in wheels).encode()).hexdigest()[:12]
    site = Path(tempfile.gettempdir()) / f"kvpp-device-site-{digest}"
    if not (site / ".complete").exists():
        partial = Path(tempfile.mkdtemp(prefix="kvpp-device-site-"))
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(partial)
        (partial / ".complete").touch()
        try:
            partial.rename(site)
        except OSError:  # another run unpacked the same wheels first
            pass
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return missing


def _has(path: str) -> bool:
    """Whether a dotted attribute path below ``torch`` (or an importable module) exists."""
    module, _, rest = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except Exception:
        return False
    for name in filter(None, rest.split(".")):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


# The torch APIs kvpp_fx and this script call that changed or appeared in recent releases.
TORCH_APIS = (
    ("torch:accelerator.current_accelerator", "kvpp_fx/runtime/device.py default_device"),
    ("torch:get_device_module", "kvpp_fx/runtime/device.py DeviceAPI"),
    ("torch.library:_register_effectful_op", "kvpp_fx/ops.py (kvpp ops are ORDERED-effectful)"),
    ("torch._library.effects:EffectType.ORDERED", "kvpp_fx/ops.py"),
    ("torch._dynamo.symbolic_convert:InstructionTranslator.current_tx", "kvpp_fx/backend.py"),
    ("torch._dynamo.backends.registry:lookup_backend", "kvpp_fx/backend.py"),
    ("torch._dynamo.backends.registry:register_backend", "kvpp_fx/backend.py"),
    ("torch._guards:detect_fake_mode", "kvpp_fx/backend.py"),
    ("torch._C:_TorchDispatchModeKey.FAKE", "kvpp_fx/ops.py RoutedOp"),
    ("torch._C:_get_dispatch_mode", "kvpp_fx/ops.py RoutedOp"),
    ("torch.library:custom_op", "kvpp_fx/reference/ops.py"),
    ("torch.distributed._functional_collectives:all_reduce", "kvpp_fx/reference/model.py TP"),
)
CUDA_APIS = (
    ("torch.cuda:_sleep", "the stalls of the ordering check"),
    ("torch.cuda:set_sync_debug_mode", "the sync count of host_time"),
    ("triton", "inductor's CUDA kernels (end_to_end)"),
)
KVPP_MODULES = ("kvpp_fx.backend", "kvpp_fx.reference.engine", "kvpp_fx.runtime.runtime", "kvpp_fx.launch")


def preflight(cuda: bool) -> dict[str, Any]:
    """What this interpreter has and lacks, named before anything deep can crash on it."""
    missing: list[str] = []
    for path, user in TORCH_APIS + (CUDA_APIS if cuda else ()):
        if not _has(path):
            missing.append(f"{path.replace(':', '.')} (used by {user})")
    if _has("torch:accelerator.current_accelerator"):
        if "check_available" not in inspect.signature(torch.accelerator.current_accelerator).parameters:
            missing.append("torch.accelerator.current_accelerator(check_available=...) (kvpp_fx/runtime/device.py)")
    if _has("torch.fx.passes.split_module:split_module"):
        from torch.fx.passes.split_module import split_module
        if "keep_original_order" not in inspect.signature(split_module).parameters:
            missing.append("split_module(keep_original_order=...) (kvpp_fx/passes/split.py)")
    if not dist.is_available() or not dist.is_gloo_available():
        missing.append("torch.distributed with gloo (both ranks)")
    for name in REQUIRED_MODULES + KVPP_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            missing.append(f"import {name}: {type(exc).__name__}: {exc}")
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "triton": _version("triton"), "pydantic": _version("pydantic"),
                "numpy": _version("numpy")}
    if cuda:
        try:
            versions["device"] = torch.cuda.get_device_name(0)
        except Exception as exc:
            missing.append(f"a usable CUDA device: {type(exc).__name__}: {exc}")
    return {"ok": not missing, "missing": missing, "versions": versions}


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except Exception:
        return None


# --- device helpers (inside a rank) -----------------------------------------------------------------

def rank_device(device_type: str) -> torch.device:
    """Both ranks on ``cuda:0``, or the CPU."""
    if device_type == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stall:
    """Stalls the current CUDA stream for about `ms` milliseconds (``torch.cuda._sleep``); nothing on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.cycles_per_ms = 0.0
        if self.cuda:
            torch.cuda._sleep(1000)  # first launch
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)

    def __call__(self, ms: float = STALL_MS) -> None:
        if self.cuda and ms > 0:
            torch.cuda._sleep(int(ms * self.cycles_per_ms))


def use_compute_stream(device: torch.device) -> None:
    """Run this rank's compute on a stream of its own.

    gloo's worker threads make the device's *default* stream wait for each collective's copy back
    (``AsyncWork::execute`` calls ``synchronize()`` on their own current stream). Compute on the default
    stream would inherit that ordering whatever the runtime's events say, and a dropped wait could not
    show.
    """
    if device.type == "cuda":
        torch.cuda.set_stream(torch.cuda.Stream(device))


def probe_collectives(device: torch.device) -> dict[str, str]:
    """Which collectives gloo runs on this device's tensors, with the right values: "ok" or what went wrong."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()

    def value(v: float) -> torch.Tensor:
        return torch.full((4,), float(v), device=device)

    def gather() -> bool:
        parts = [value(-1) for _ in range(world)] if rank == 0 else None
        dist.gather(value(rank), parts, dst=0, group=group, async_op=True).wait()
        return rank != 0 or all(bool((p == r).all()) for r, p in enumerate(parts))

    def scatter() -> bool:
        out = value(-1)
        dist.scatter(out, [value(r) for r in range(world)] if rank == 0 else None, src=0, group=group,
                     async_op=True).wait()
        return bool((out == rank).all())

    def broadcast() -> bool:
        t = value(rank)
        dist.broadcast(t, src=0, group=group, async_op=True).wait()
        return bool((t == 0).all())

    def all_reduce_max() -> bool:
        t = value(rank)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
        return bool((t == world - 1).all())

    out = {}
    for name, run in (("broadcast", broadcast), ("all_reduce(MAX)", all_reduce_max), ("gather", gather),
                      ("scatter", scatter)):
        try:
            out[name] = "ok" if run() else "wrong values"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    synchronize(device)
    dist.barrier()
    return out


# --- the seam: one dropped wait, or a link whose bytes land late -------------------------------------

def _base_api():
    from kvpp_fx.runtime.device import DeviceAPI
    return DeviceAPI


class _LateWork:
    """A broadcast into a shadow buffer; its bytes reach the real destination only when waited for."""

    def __init__(self, inner: Any, tensor: torch.Tensor, shadow: torch.Tensor, receive: bool) -> None:
        self.inner, self.tensor, self.shadow, self.receive = inner, tensor, shadow, receive

    def land(self) -> None:
        if self.receive:
            self.tensor.copy_(self.shadow)  # on the waiting stream


def make_seam_api(device: torch.device, *, drop: str | None = None, late_ms: float = 0.0, stall: Stall | None = None):
    """A `DeviceAPI` with one fault or a slow link (module-level classes cannot subclass a lazy import).

    ``drop="ready"``: the transfer stream's event waits are lost (a broadcast may read the owner's view,
    or write a slot, while the compute stream still uses it). ``drop="done"``: the compute stream's
    event waits are lost (attention may read a slot before the broadcast filled it). ``drop="work"``:
    ``wait_work`` does nothing (a collective's output may be read before it lands; the host waits at
    the forward's end still happen). ``late_ms``: each broadcast runs into a shadow buffer whose bytes
    are copied into the destination on the waiting stream after a stall, as a slow link delivers them.
    ``dropped`` counts the waits the seam swallowed: a control that dropped none proves nothing.
    """
    DeviceAPI = _base_api()

    class DroppingEvent(torch.cuda.Event):
        def __new__(cls, api):
            return super().__new__(cls)

        def __init__(self, api) -> None:
            self.api = api

        def wait(self, stream=None) -> None:
            stream = stream if stream is not None else torch.cuda.current_stream()
            if self.api.drops_wait_of(stream):
                self.api.dropped += 1
                return
            super().wait(stream)

    class SeamDeviceAPI(DeviceAPI):
        def __init__(self) -> None:
            super().__init__(device)
            self.drop, self.late_ms, self.stall = drop, late_ms, stall
            self.dropped = 0
            self._transfer_streams: list[Any] = []
            self._shadows: dict[tuple, torch.Tensor] = {}

        def new_stream(self) -> Any:
            stream = super().new_stream()
            self._transfer_streams.append(stream)  # the runtime's only own streams carry transfers
            return stream

        def new_event(self) -> Any:
            if self.is_cpu or self.drop not in ("ready", "done"):
                return super().new_event()
            return DroppingEvent(self)

        def drops_wait_of(self, stream: Any) -> bool:
            transfer = any(stream == s for s in self._transfer_streams)
            return (self.drop == "ready" and transfer) or (self.drop == "done" and not transfer)

        def broadcast(self, tensor, src, group):
            if not self.late_ms:
                return super().broadcast(tensor, src, group)
            key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
            shadow = self._shadows.get(key)
            if shadow is None:
                shadow = self._shadows[key] = torch.empty_like(tensor)
            receive = src != dist.get_rank()
            if not receive:
                shadow.copy_(tensor)  # on the transfer stream, after its wait on ready
            return _LateWork(super().broadcast(shadow, src, group), tensor, shadow, receive)

        def wait_work(self, work, timeout) -> None:
            if self.drop == "work":
                self.dropped += 1
                return
            if isinstance(work, _LateWork):
                super().wait_work(work.inner, timeout)
                if self.stall is not None:
                    self.stall(self.late_ms)
                work.land()
                return
            super().wait_work(work, timeout)

        def host_wait_work(self, work, timeout) -> None:
            if isinstance(work, _LateWork):
                super().host_wait_work(work.inner, timeout)
                work.land()
                synchronize(device)
                return
            super().host_wait_work(work, timeout)

    return SeamDeviceAPI()


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


# --- the parent: run, judge, report ------------------------------------------------------------------------

@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    figure: str
    details: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"device-check {self.name}: {self.status} {self.figure}"


def _run(fn, *args, timeout_s: float, pg_timeout_s: float = 60.0) -> tuple[list[Any] | None, str | None]:
    """The ranks' results, or the reason there are none (a rank raised, died or ran out of time)."""
    from kvpp_fx.launch import RankFailure, run_ranks

    try:
        return run_ranks(fn, WORLD, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s), None
    except RankFailure as exc:
        return None, _first_words(str(exc))
    except Exception as exc:  # the launch itself failed
        return None, f"{type(exc).__name__}: {exc}"


def _first_words(failure: str) -> str:
    """Each failed rank's headline and the last line of its traceback, on one line."""
    blocks: list[list[str]] = []
    for line in filter(str.strip, failure.splitlines()):
        if line.startswith("rank ") or not blocks:
            blocks.append([line])
        else:
            blocks[-1].append(line)
    return " | ".join(" ".join(dict.fromkeys((block[0], block[-1]))) for block in blocks)


def judge_ordering(results: list[dict[str, Any]], cuda: bool) -> Check:
    problems, caught, exact, skipped = [], 0, 0, []
    for name, *_, control in ORDER_SCENARIOS:
        per_rank = [r["scenarios"][name] for r in results]
        if "skipped" in per_rank[0]:
            skipped.append(f"{name} ({per_rank[0]['skipped']})")
            continue
        wrong = sum(r["n_wrong"] or 0 for r in per_rank)
        errors = [r["error"] for r in per_rank if "error" in r]
        if control:
            dropped = sum(r["dropped_waits"] for r in per_rank)
            detected = wrong > 0 or bool(errors)
            caught += detected
            if cuda and not detected:
                problems.append(f"{name}: not caught ({dropped} waits dropped)")
        elif errors or wrong:
            problems.append(f"{name}: {errors[0] if errors else f'{wrong} reads differ'}")
        else:
            exact += 1
    controls = sum(1 for *_, c in ORDER_SCENARIOS if c)
    positives = len(ORDER_SCENARIOS) - controls
    details = {"ranks": results}
    skip_note = f"; skipped {'; '.join(skipped)}" if skipped else ""
    if problems:
        return Check("ordering", "FAIL", "; ".join(problems) + skip_note, details)
    stall = (f"{STALL_MS:g} ms compute stalls before every ready point, done point and read, or bytes "
             f"landing {LATE_MS:g} ms late" if cuda else "CPU smoke: bytes exact, streams and events are no-ops")
    if cuda:
        figure = f"{exact}/{positives} scenarios exact under {stall}; negative controls caught {caught}/{controls}"
    else:
        figure = f"{exact}/{positives} scenarios exact ({stall}); negative controls not meaningful on CPU " \
                 f"(caught {caught}/{controls})"
    if skipped and cuda:
        return Check("ordering", "FAIL", figure + skip_note, details)
    return Check("ordering", "PASS", figure + skip_note, details)


def judge_end_to_end(results: list[dict[str, Any]], cuda: bool, inner: str) -> Check:
    first = results[0]
    details = {"inner": inner, "ranks": results}
    per_mode = []
    for mode in first["modes"]:
        issues: dict[str, list[int]] = {}  # one message for the ranks that share it
        for rank, res in enumerate(results):
            for issue in _mode_issues(mode, res["runs"][mode]):
                issues.setdefault(issue, []).append(rank)
        run = first["runs"][mode]
        if issues:
            per_mode.append((False, f"{mode}: " + "; ".join(
                f"{issue} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
                for issue, ranks in issues.items())))
        else:
            note = (f", chose owner in {run['step_modes'].count('owner')} of {len(run['step_modes'])} steps"
                    if mode == "auto" else "")
            per_mode.append((True, f"{mode} identical (max |logit diff| {_fmt_diff(run['max_logit_diff'])}{note})"))
    missing = [m for m in ("broadcast", "owner", "auto") if m not in first["modes"]]
    if missing:
        per_mode.append((False, f"{', '.join(missing)} not run: gloo gather/scatter on the device: "
                                f"{first['probes']['gather']}; {first['probes']['scatter']}"))
    ok = all(passed for passed, _ in per_mode)
    figure = (f"tokens vs KVPP off ({first['off']['steps']} steps, TP {len(results)}, piecewise/{inner}, active "
              f"blocks): " + "; ".join(text for _, text in per_mode)
              + f"; KVPP off took {first['off_seconds']:.0f} s with its compiles" + ("" if cuda else " (CPU smoke)"))
    return Check("end_to_end", "PASS" if ok else "FAIL", figure, details)


def _mode_issues(mode: str, run: dict[str, Any]) -> list[str]:
    if "error" in run:
        return [f"raised at step {run['steps_done']}: {run['error']}"]
    issues = [] if run["identical"] else ["tokens differ from KVPP off"]
    if mode == "broadcast" and not (run["active_steps"] and run["broadcast_bytes"]):
        issues.append("no step moved active blocks")
    if mode == "owner" and set(run["step_modes"]) != {"owner"}:
        issues.append(f"steps ran {sorted(set(run['step_modes']))}")
    if mode == "auto" and set(run["step_modes"]) != {"broadcast", "owner"}:
        issues.append(f"chose only {sorted(set(run['step_modes']))}")
    return issues


def _fmt_diff(value: float | None) -> str:
    return "n/a (step shapes differ)" if value is None else f"{value:.1e}"


def judge_overlap(results: list[dict[str, Any]], cuda: bool) -> Check:
    res = results[0]["overlap"]
    hidden = res["hidden_fraction_vs_compute"]
    med = res["median_s"]
    figure = (f"{hidden:.3f} of the transfer hidden (1 - exposed/transfer; {res['hidden_fraction']:.3f} by "
              f"(serial - overlapped)/transfer) behind {res['matmuls_per_layer']} matmuls per layer, "
              f"{res['layers']} x {res['layer_bytes'] // 2**20} MiB layers; transfer {med['transfer'] * 1e3:.1f} ms, "
              f"overlapped {med['overlapped'] * 1e3:.1f} ms, compute {med['compute'] * 1e3:.1f} ms")
    details = {"ranks": [r["overlap"] for r in results], "goal": OVERLAP_GOAL}
    if not cuda:
        return Check("overlap", "PASS", figure + " (CPU smoke: gloo and the matmuls share the cores)", details)
    status = "PASS" if hidden >= OVERLAP_GOAL else "FAIL"
    return Check("overlap", status, f"{figure} (goal >= {OVERLAP_GOAL})", details)


def judge_host_time(results: list[dict[str, Any]], cuda: bool) -> Check:
    res = results[0]["host_time"]
    cpu = _cpu_overhead()
    on = "CUDA streams" if cuda else "CPU (smoke)"
    figure = (f"{res['us_per_layer_with_history']:.1f} us per layer with history, "
              f"{res['us_per_layer_without_history']:.1f} us without, on {on}, no-op transport, {res['layers']} "
              f"layers; CPU figure {cpu}")
    details = {"ranks": [r["host_time"] for r in results], "cpu_figure": cpu}
    if not cuda:
        return Check("host_time", "PASS", figure + "; CUDA syncs not counted on CPU", details)
    syncs = results[0]["syncs"]
    details["syncs"] = [r["syncs"] for r in results]
    in_layers = {path: max(r["syncs"][path]["in_layers"] for r in results) for path in syncs}
    per_forward = {path: max(r["syncs"][path]["per_forward"] for r in results) for path in syncs}
    figure += "; CUDA syncs on the forward's thread: " + ", ".join(
        f"{path} {in_layers[path]} in {syncs[path]['layers']} layers, {per_forward[path]} per forward"
        for path in syncs)
    return Check("host_time", "PASS" if not any(in_layers.values()) else "FAIL", figure, details)


def _cpu_overhead() -> str:
    try:
        ro = json.loads(CPU_OVERHEAD.read_text())
        return (f"{ro['us_per_layer_with_history']['median']:.1f} us with history, "
                f"{ro['us_per_layer_without_history']['median']:.1f} us without "
                f"(benchmarks/results/runtime_overhead.json)")
    except (OSError, KeyError, ValueError):
        return "unavailable (benchmarks/results/runtime_overhead.json unreadable)"


COULD_NOT_RUN = (
    "device ordering: on CPU streams and events are no-ops, so the stalls are absent and only the bytes "
    "were checked",
    "negative controls (transfer stream skips ready, compute stream skips done, exchanges skip Work.wait()): "
    "not meaningful on CPU",
    "gloo collectives on CUDA tensors",
    "inductor on CUDA (the smoke pass compiles the pieces with aot_eager on CPU)",
    "overlap behind real GPU compute",
    "host time with CUDA streams and the count of CUDA synchronisations",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help=f"JSON result (default {GPU_RESULT} on a GPU, "
                                                    f"{SMOKE_RESULT} on the CPU smoke pass)")
    parser.add_argument("--wheels", default=str(ROOT / ".device-wheels"),
                        help="wheels of the pure-Python packages this interpreter may lack (make device-wheels)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole run")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--cpu", action="store_true", help="the CPU smoke pass even where a GPU is present")
    parser.add_argument("--inner", default=None,
                        help="end_to_end's inner backend (default: inductor on a GPU, aot_eager on CPU)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    deadline = began + args.budget_s
    wanted = [c for c in CHECKS if c in args.only.split(",")]
    unknown = sorted(set(args.only.split(",")) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; the checks are {', '.join(CHECKS)}")

    lacked = use_wheels(Path(args.wheels))
    cuda = torch.cuda.is_available() and not args.cpu
    device_type = "cuda" if cuda else "cpu"
    env = preflight(cuda)
    versions = env["versions"]
    where = versions.get("device", "CPU smoke pass, no GPU" if not args.cpu else "CPU smoke pass (--cpu)")
    wheels_note = f"; from the wheels: {', '.join(lacked)}" if lacked and not env["missing"] else ""
    pre = Check("preflight", "PASS" if env["ok"] else "FAIL",
                f"{where}; Python {versions['python']}, torch {versions['torch']}, triton {versions['triton']}"
                f"{wheels_note}" + ("" if env["ok"] else "; missing: " + "; ".join(env["missing"])
                                    + ("" if importlib.util.find_spec("pydantic") else
                                       f" (no wheels in {args.wheels}: run make device-wheels where pip reaches "
                                       "the index and bring the folder along)")), env)
    print(pre.line(), flush=True)
    checks = [pre]
    inner = args.inner or ("inductor" if cuda else "aot_eager")
    if env["ok"]:
        checks += run_checks(wanted, device_type, cuda, inner, deadline)
    else:
        for name in wanted:
            checks.append(Check(name, "FAIL", "not run: the preflight names what is missing"))
            print(checks[-1].line(), flush=True)
    duration = time.monotonic() - began
    print(f"device-check: {'GPU run' if cuda else 'smoke pass on CPU'} in {duration:.0f} s", flush=True)
    if not cuda:
        print("device-check: could not run here: " + "; ".join(COULD_NOT_RUN), flush=True)
    result = {"device": device_type, "smoke": not cuda, "duration_s": duration,
              "checks": {c.name: asdict(c) for c in checks},
              "summary": [c.line() for c in checks], "could_not_run": [] if cuda else list(COULD_NOT_RUN)}
    from _common import write_result

    write_result("device_check", result, args.out or str(GPU_RESULT if cuda else SMOKE_RESULT))
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def run_checks(wanted: list[str], device_type: str, cuda: bool, inner: str, deadline: float) -> list[Check]:
    """Each check in its own ranks, so a crash or a hang in one costs only its own time."""
    out, overlap_results = [], None
    limits = {"ordering": 150.0, "overlap": 150.0, "host_time": 150.0}
    for name in wanted:
        left = deadline - time.monotonic() - 5.0
        if left < 20:
            check = Check(name, "FAIL" if cuda else "SKIP", f"not run: {max(0, int(left + 5))} s of the budget left")
        elif name == "ordering":
            check = _judged(name, _run(ordering_worker, device_type, timeout_s=min(left, limits[name])),
                            judge_ordering, cuda)
        elif name in ("overlap", "host_time"):
            if overlap_results is None:  # one launch measures both
                overlap_results = _run(overlap_worker, device_type, not cuda, timeout_s=min(left, limits[name]))
            check = _judged(name, overlap_results, judge_overlap if name == "overlap" else judge_host_time, cuda)
        else:
            check = _judged(name, _run(end_to_end_worker, device_type, inner, timeout_s=left, pg_timeout_s=180.0),
                            judge_end_to_end, cuda, inner)
        print(check.line(), flush=True)
        out.append(check)
    return out


def _judged(name: str, run: tuple[list[Any] | None, str | None], judge, *args: Any) -> Check:
    results, why = run
    if results is None:
        return Check(name, "FAIL", f"no result: {why}")
    try:
        return judge(results, *args)
    except Exception as exc:  # a result of an unexpected shape must not cost the other checks' report
        return Check(name, "FAIL", f"could not judge the result: {type(exc).__name__}: {exc}", {"ranks": results})


if __name__ == "__main__":
    sys.exit(main())
