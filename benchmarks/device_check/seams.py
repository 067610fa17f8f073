"""Device helpers inside a rank, and the fault seam: one dropped wait, or a link whose bytes land late."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.device_check import STALL_MS


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


