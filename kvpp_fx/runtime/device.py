"""Device-generic streams, events and process-group backends.

Everything goes through ``torch.get_device_module(device)`` so that one code path serves CPU (gloo),
CUDA (NCCL) and Ascend NPU (HCCL). On CPU, torch's own stream and event classes are no-ops, and the
gloo work runs on its own thread. torch_npu is imported only on demand, inside a guard.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

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
        if self.device.type == "npu":
            try_import_torch_npu()
        self.module = torch.get_device_module(self.device.type)

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    def new_stream(self) -> Any:
        return self.module.Stream() if self.is_cpu else self.module.Stream(device=self.device)

    def current_stream(self) -> Any:
        return self.module.current_stream() if self.is_cpu else self.module.current_stream(self.device)

    def new_event(self) -> Any:
        return self.module.Event()

    def stream(self, stream: Any) -> Any:
        return self.module.stream(stream)

    def record_event(self, stream: Any | None = None) -> Any:
        event = self.new_event()
        event.record(stream if stream is not None else self.current_stream())
        return event
