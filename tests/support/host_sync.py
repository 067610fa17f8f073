"""A host-sync detector, and one vLLM step of a KVPP engine driven on the `meta` device.

On a GPU, a step that reads a device value on the host (``.item()``, ``.tolist()``, ``bool()``, a copy to
the host) waits for the device, and so does a blocking copy of host values to it (from pageable memory,
as ``torch.tensor(values, device=...)`` makes). On a CPU host nothing waits, so the detector puts the
step's device values on the ``meta`` device, where such a read cannot return a value: `HostSyncDetector`
(a torch function mode) counts every host read of a non-CPU tensor and every blocking upload to one, and
raises `HostSyncError` naming it, before torch's own meta error.

`MetaDeviceAPI` is a `DeviceAPI` on ``meta`` with a no-op transport: streams and events that do
nothing, collectives that complete at once and move nothing, and deferred reads that never touch the
device (the device's own pinned copy cannot run on a CPU-only torch; its `DeviceAPI.read_later` is a
non-blocking copy and an event). It reports `immediate_checks` False, as a device does.

`VllmStep` drives `kvpp_fx.integrations.vllm.engine.step.step_forward` as vLLM's runners do: a V1 `StepBatch`
of host arrays, vLLM's MLA metadata with meta block tables in a vLLM forward context, every target
layer's turn (owner exchanges where the forward sends rows to the owner) and the forward's end.
"""

from __future__ import annotations

import contextlib
import time
import types
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from kvpp_fx.runtime.device import DeferredRead, DeviceAPI

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}


class HostSyncError(AssertionError):
    """A step read a device value on the host, or copied host values to the device with a blocking copy."""


class HostSyncDetector(TorchFunctionMode):
    """Counts host reads of non-CPU tensors (``reads``) and blocking uploads of host values to a non-CPU
    device (``uploads``: a copy from pageable host memory waits for the device's stream, as
    ``torch.tensor(values, device=...)``, ``.to(device)`` or ``.copy_`` without ``non_blocking``, or a host
    list or CPU tensor indexing a device tensor do); ``strict`` raises `HostSyncError` at the first.
    ``torch.tensor`` is not a torch function, so the detector wraps it while it is active."""

    def __init__(self, strict: bool = True) -> None:
        super().__init__()
        self.strict = strict
        self.reads: list[str] = []
        self.uploads: list[str] = []
        self._tensor = None  # torch.tensor as found on entry, restored on exit

    def __enter__(self):
        factory = self._tensor = torch.tensor

        def tensor(data, *args, **kwargs):
            if not _on_host(kwargs.get("device")):
                self._found(self.uploads, "tensor", f"uploaded host values to {kwargs['device']} with a blocking copy")
            return factory(data, *args, **kwargs)

        torch.tensor = tensor
        return super().__enter__()

    def __exit__(self, *exc):
        torch.tensor = self._tensor
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu" and self._reads_host(func, args,
                                                                                                       kwargs):
            self._found(self.reads, name, f"read a {args[0].device.type} tensor on the host")
        elif self._uploads_blocking(func, args, kwargs):
            self._found(self.uploads, name, "uploaded host values to the device with a blocking copy")
        return func(*args, **kwargs)

    def _found(self, into: list[str], name: str, what: str) -> None:
        into.append(name)
        if self.strict:
            raise HostSyncError(f"the step {what} ({name}).")

    @staticmethod
    def _uploads_blocking(func, args, kwargs) -> bool:
        if func is torch.as_tensor:
            on_device = isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"
            return not on_device and not _on_host(kwargs.get("device"))
        if not args or not isinstance(args[0], torch.Tensor):
            return False
        if func is torch.Tensor.new_tensor:  # host values onto self's device
            return args[0].device.type != "cpu" and not (isinstance(args[1], torch.Tensor)
                                                          and args[1].device.type != "cpu")
        if func in (torch.Tensor.to, torch.Tensor.cuda) and args[0].device.type == "cpu":
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            target = target.device if isinstance(target, torch.Tensor) else target
            if func is torch.Tensor.cuda:
                target = "cuda"
            return isinstance(target, (str, torch.device)) and not _on_host(target) and not kwargs.get("non_blocking")
        if func is torch.Tensor.copy_:
            return (args[0].device.type != "cpu" and isinstance(args[1], torch.Tensor) and args[1].device.type == "cpu"
                    and not kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and args[0].device.type != "cpu":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            value = (args[2],) if func is torch.Tensor.__setitem__ else ()
            return any(isinstance(i, list) or (isinstance(i, torch.Tensor) and i.device.type == "cpu" and i.dim() > 0)
                       for i in (*index, *value))
        return False

    @staticmethod
    def _reads_host(func, args, kwargs) -> bool:
        if func in HOST_READS:
            return True
        if func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
        return False


def _on_host(device: Any) -> bool:
    return device is None or torch.device(device).type == "cpu"


class _NoOpStream:
    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


class _DoneEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _DoneWork:
    def wait(self, timeout: Any = None) -> bool:
        return True


class MetaDeviceAPI(DeviceAPI):
    """A device that never answers the host: the ``meta`` device, with a no-op transport."""

    orders_streams = True
    immediate_checks = False

    def __init__(self, device: Any = "meta") -> None:
        self.device = torch.device("meta")
        self.is_cpu = False
        self.module = None
        self.host_waits = 0  # works the host waited for (the agreement's, on its host group, excluded)

    def new_stream(self) -> _NoOpStream:
        return _NoOpStream()

    def current_stream(self) -> _NoOpStream:
        return _NoOpStream()

    def new_event(self) -> _DoneEvent:
        return _DoneEvent()

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext(stream)

    def upload(self, ids: np.ndarray) -> torch.Tensor:
        return torch.empty(ids.shape, dtype=torch.int64, device="meta")

    def read_later(self, value: torch.Tensor) -> DeferredRead:
        """A meta value has no bytes: the stand-in reads as the flag of checks that passed (0)."""
        assert value.device.type == "meta"
        return DeferredRead(torch.zeros((), dtype=value.dtype), _DoneEvent())

    def broadcast(self, tensor, src, group):
        return _DoneWork()

    def all_reduce_max(self, tensor, group):
        """The checks' flag (on meta) moves nothing; the agreement (a host tensor, its host group) runs."""
        if tensor.device.type == "meta":
            return _DoneWork()
        return super().all_reduce_max(tensor, group)

    def gather(self, tensor, gather_list, dst, group):
        return _DoneWork()

    def scatter(self, tensor, scatter_list, src, group):
        return _DoneWork()

    def wait_work(self, work, timeout) -> None:
        work.wait()

    def host_wait_work(self, work, timeout) -> None:
        if isinstance(work, _DoneWork):
            self.host_waits += 1
        work.wait(timeout)


def meta_device_api(device: Any = "meta") -> MetaDeviceAPI:
    return MetaDeviceAPI(device)


class PlantedItemAPI(MetaDeviceAPI):
    """The negative control: an upload that reads how many ids it uploads from the device."""

    def upload(self, ids: np.ndarray) -> torch.Tensor:
        out = super().upload(ids)
        int(out.numel() and out.sum().item())
        return out


LAYER_NAME = "model.layers.{}.self_attn.attn"


def mla_metadata(batch: Any, num_decodes: int, device: str = "meta") -> Any:
    """vLLM's MLA metadata for `batch` (a `StepBatch`), the first `num_decodes` requests decoding, its
    tensors on `device`."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonDecodeMetadata,
        MLACommonMetadata,
        MLACommonPrefillMetadata,
    )

    rows = batch.tables[0].rows
    n, width = rows.shape
    tokens = int(batch.query_lens.sum())
    decode_tokens = int(batch.query_lens[:num_decodes].sum())
    table = torch.empty((n, width), dtype=torch.int32, device=device)
    decode = prefill = None
    if num_decodes:
        decode = MLACommonDecodeMetadata(table[:num_decodes],
                                         torch.empty(num_decodes, dtype=torch.int32, device=device), None)
    if num_decodes < n:
        prefill = MLACommonPrefillMetadata(table[num_decodes:], torch.empty(n - num_decodes + 1, dtype=torch.int32,
                                                                            device=device),
                                           int(batch.query_lens[num_decodes:].max()))
    return MLACommonMetadata(n, int(batch.query_lens.max()), int((batch.num_computed + batch.query_lens).max()),
                             tokens, torch.empty(n + 1, dtype=torch.int32, device=device),
                             torch.empty(tokens, dtype=torch.int64, device=device), num_decodes, decode_tokens,
                             n - num_decodes, prefill=prefill, decode=decode)


class VllmStep:
    """One KVPP engine's steps as vLLM's runners drive `step.step_forward`, on a runtime built by the
    caller (its storage on ``meta``, its device API a `MetaDeviceAPI`)."""

    def __init__(self, runtime: Any, mode: str) -> None:
        from kvpp_fx.cache.cost import Mode
        from kvpp_fx.integrations.vllm.attention.owner_rows import MQA_RULE
        from kvpp_fx.integrations.vllm.engine.state import AttentionChoices, Communication, EngineState, Layout

        plan = runtime.plan
        self.runtime = runtime
        self.rule = MQA_RULE
        self.names = {LAYER_NAME.format(layer): layer for layer in plan.target_layers}
        vplan = types.SimpleNamespace(plan=plan, layer_index=dict(self.names))
        self.state = EngineState(config=types.SimpleNamespace(pcp=1), vllm_config=None, layout=Layout(vplan=vplan),
                                 comm=Communication(runtime=runtime),
                                 attention=AttentionChoices(mode=Mode(mode), metadata_layer=next(iter(self.names))))

    def batch(self, computed: list[int], query: list[int], rows: np.ndarray, block_size: int) -> Any:
        """The `StepBatch` the V1 adapter builds from its host arrays."""
        from kvpp_fx.integrations.vllm.engine.batch import BlockRows, StepBatch

        return StepBatch.of(computed, query, computed, (BlockRows(block_size, rows),))

    def run(self, make_batch: Any, num_decodes: int) -> dict[str, float]:
        """One step: `make_batch()` (the adapter's host work) and the forward's opening up to the first
        layer's prefetch, timed; every layer's turn (not timed); the forward's end, timed."""
        from vllm.forward_context import ForwardContext, override_forward_context

        from kvpp_fx.integrations.vllm.engine.step import step_forward

        runtime, attention = self.runtime, self.runtime.attention
        schedule = runtime.plan.schedule()
        metadata = mla_metadata(make_batch(), num_decodes)  # vLLM's own work: its builder's, not timed
        context = ForwardContext(no_compile_layers={}, attn_metadata={name: metadata for name in self.names},
                                 slot_mapping={name: metadata.slot_mapping for name in self.names})
        start = time.perf_counter()
        batch = make_batch()
        with override_forward_context(context):
            forward = step_forward(self.state, batch)
            forward.__enter__()
            steps = list(schedule.steps())
            first = steps[0]
            runtime.prefetch(first.layer, first.slot)
            opened = time.perf_counter()
            error = None
            try:
                for step in steps[1:]:
                    if step.kind == "wait":  # vLLM's MLA layers route their own decode rows (`owner_rows`)
                        runtime.wait(step.layer, step.slot, routed=True)
                        if runtime.path.owner_tokens:
                            self._exchange(step.layer, attention)
                    else:
                        runtime.prefetch(step.layer, step.slot)
            except BaseException as exc:  # noqa: BLE001 - handed to the forward's end, as a with statement does
                error = exc
            closing = time.perf_counter()
            if error is None:
                forward.__exit__(None, None, None)
            elif not forward.__exit__(type(error), error, error.__traceback__):
                raise error
            end = time.perf_counter()
        # the host waits for the agreement when the forward ends; on a device the layers' work runs while it
        # is in flight (here the layers take no time), so that wait is reported on its own
        agreement_s = runtime.parts.agreement.last_wait_s if runtime.parts.agreement is not None else 0.0
        return {"host_ms": ((opened - start) + (end - closing) - agreement_s) * 1e3,
                "agreement_wait_ms": agreement_s * 1e3, "mode": str(runtime.last_forward()["mode"])}

    def _exchange(self, layer: int, attention: Any) -> None:
        tokens, heads = self.runtime.path.owner_tokens, attention.split(self.runtime.plan.group_size)
        query = torch.empty(tokens, heads, attention.q_width, device="meta")
        like = torch.empty(tokens, heads, attention.out_width, device="meta")
        self.runtime.open_turn.owner_compute(
            self.rule, [query], lambda full: torch.empty(tokens, heads * self.runtime.plan.group_size,
                                                         attention.out_width, device="meta"), output_like=like)
