"""Device-generic streams, events, collectives and process-group backends.

Everything goes through ``torch.get_device_module(device)`` so that one code path serves CPU (gloo),
CUDA (NCCL) and Ascend NPU (HCCL). On CPU, torch's own stream and event classes are no-ops, and the
gloo work runs on gloo's own threads. torch_npu is imported only on demand, inside a guard.

`DeviceAPI` is the runtime's only door to device ordering: every stream, event and collective call goes
through it, so a recording subclass can log them and prove the ordering on a CPU host. It is also the
runtime's only seam: the tests' faults are `DeviceAPI` subclasses, passed to
``KVPPRuntime.create(device_api=...)`` or, across process boundaries, named as ``"module:callable"``
(`resolve_device_api`).
"""

from __future__ import annotations

import importlib
import logging
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PROCESS_GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl"}


def try_import_torch_npu() -> Any | None:
    """torch_npu registers the "npu" device with torch; it is optional and never required."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def default_device() -> torch.device:
    """The current accelerator when one is available, else the CPU."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None and try_import_torch_npu() is not None:
        accelerator = torch.accelerator.current_accelerator(check_available=True)
    return torch.device(accelerator.type) if accelerator is not None else torch.device("cpu")


def process_group_backend(device: torch.device | str) -> str:
    device_type = torch.device(device).type
    try:
        return PROCESS_GROUP_BACKENDS[device_type]
    except KeyError:
        raise ValueError(f"no KVPP process-group backend for device type {device_type!r}.") from None


class DeviceAPI:
    """Streams and events of one device type, as its torch device module provides them."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.is_cpu = self.device.type == "cpu"
        if self.device.type == "npu":
            try_import_torch_npu()
        self.module = torch.get_device_module(self.device.type)

    @property
    def orders_streams(self) -> bool:
        """Whether the runtime must make its stream, event and stream-context calls.

        On CPU torch's streams and events do nothing, so the runtime skips them, which is most of its
        host cost per layer. A CPU subclass that observes them (the tests' recording API) says True.
        """
        return not self.is_cpu

    @property
    def immediate_checks(self) -> bool:
        """Whether a check computed on the device is read on the host at once, or once at forward end.

        On CPU the value is there as soon as the kernel returns, so the runtime reads it where it is
        computed and raises at that op. On a device reading it would synchronise the host with the
        stream, so the runtime accumulates such checks and reads them once when the forward ends.
        """
        return self.is_cpu

    def new_stream(self) -> Any:
        return self.module.Stream() if self.is_cpu else self.module.Stream(device=self.device)

    def current_stream(self) -> Any:
        return self.module.current_stream() if self.is_cpu else self.module.current_stream(self.device)

    def new_event(self) -> Any:
        return self.module.Event()

    def stream(self, stream: Any) -> Any:
        return self.module.stream(stream)

    # --- host and device values, without the host waiting ----------------------------------------

    def upload(self, ids: np.ndarray) -> torch.Tensor:
        """Host int64 ids on the device, without the host waiting for the device: on CPU the array
        itself; elsewhere a pinned copy, moved by a non-blocking copy on the current stream (torch's
        pinned-memory allocator keeps the copy's buffer until that copy completed)."""
        host = torch.from_numpy(ids)
        if self.is_cpu:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def read_later(self, value: torch.Tensor) -> DeferredRead:
        """A device scalar, read on the host once the current stream reached this point: a non-blocking
        copy into pinned memory and an event behind it; the host waits only when it asks for the value
        before the event completed (`DeferredRead.value`)."""
        if self.is_cpu:  # the value is there already (a CPU API with a device's order of checks)
            return DeferredRead(value.detach().clone(), _Completed())
        host = torch.empty((), dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        event = self.new_event()
        event.record(self.current_stream())
        return DeferredRead(host, event)

    # --- packed blocks ----------------------------------------------------------------------------

    def gather_blocks(self, source: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out[j] = source[ids[j]]`` on the current stream, into preallocated memory."""
        torch.index_select(source, 0, ids, out=out)

    def remap_block_table(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each block id of `table` as its position in the packed slot (``positions[id]``); negative
        entries (padding) stay. Same shape and dtype."""
        mapped = positions.index_select(0, table.clamp(min=0).reshape(-1).long()).view(table.shape)
        return torch.where(table >= 0, mapped.to(table.dtype), table)

    def remap_slot_mapping(self, slots: torch.Tensor, positions: torch.Tensor, block_size: int,
                           slot_blocks: int) -> torch.Tensor:
        """Each token slot ``block * block_size + offset`` moved with its block; -1 (padding) stays, and
        a slot of a block the packed list does not hold becomes -1 (the write is dropped)."""
        valid = slots >= 0
        safe = slots.clamp(min=0).long()
        block = positions.index_select(0, (safe // block_size).reshape(-1)).view(slots.shape)
        moved = block * block_size + safe % block_size
        keep = valid & (block < slot_blocks)
        return torch.where(keep, moved, torch.full_like(moved, -1)).to(slots.dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into `dst` on the current stream (a prefetched history chunk into its workspace)."""
        dst.copy_(src)

    # --- collectives ------------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> Any:
        """Issue an async broadcast on the current stream; returns its work handle."""
        return dist.broadcast(tensor, src=src, group=group, async_op=True)

    def all_reduce_max(self, tensor: torch.Tensor, group: Any) -> Any:
        """Issue an async elementwise-max all-reduce on the current stream; returns its work handle."""
        return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, group: Any) -> Any:
        """Issue an async gather of every rank's `tensor` into `gather_list` on rank `dst` (owner mode)."""
        return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=True)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, group: Any) -> Any:
        """Issue an async scatter of `scatter_list[r]` from rank `src` into rank r's `tensor` (owner mode)."""
        return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=True)

    def wait_work(self, work: Any, timeout: timedelta) -> None:
        """Order everything issued later on the current stream after `work`.

        On CPU the host itself waits, bounded by `timeout` (gloo raises on expiry). On a device the
        current stream waits and the host does not: a timeout given to ``Work.wait`` would block the
        host (NCCL's does), so the bound there is the communicator's watchdog, which aborts a
        collective that does not complete within the group's timeout.
        """
        if self.is_cpu:
            work.wait(timeout)
        else:
            work.wait()

    def host_wait_work(self, work: Any, timeout: timedelta) -> None:
        """Block the host until `work` completes or `timeout` expires (raises on expiry)."""
        work.wait(timeout)


class _Completed:
    """The event of a value computed on the host: complete from the start."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class DeferredRead:
    """A device value copied toward the host behind an event (`DeviceAPI.read_later`)."""

    __slots__ = ("host", "event")

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self.host = host
        self.event = event

    def ready(self) -> bool:
        """Whether the value is on the host (never waits)."""
        return bool(self.event.query())

    def value(self) -> int:
        """The value; waits for the event when it has not completed (where the caller already waited
        for the stream, for vLLM's own output, this costs nothing)."""
        if not self.event.query():
            self.event.synchronize()
        return int(self.host)


def resolve_device_api(factory: str, device: torch.device | str) -> DeviceAPI:
    """``"package.module:callable"`` called with the cache's device: a `DeviceAPI` named by a string, so
    that it crosses process boundaries (spawned ranks, vLLM workers). Tests name their faults this way."""
    module_name, sep, name = factory.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"a device API factory is 'module:callable', got {factory!r}.")
    target: Any = importlib.import_module(module_name)
    for part in name.split("."):
        target = getattr(target, part)
    api = target(torch.device(device))
    if not isinstance(api, DeviceAPI):
        raise TypeError(f"{factory} returned {type(api).__name__}, not a DeviceAPI.")
    return api
