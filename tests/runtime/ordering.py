"""Device ordering proven on a CPU host: a recording device API and a happens-before checker.

On CPU, torch's streams and events do nothing, so running cannot show device ordering. The
`RecordingDeviceAPI` has the real `DeviceAPI`'s interface; it logs every stream, event and collective
call (and still runs the real collectives, so the bytes move). Tests log attention's reads and writes
with `access`. `check_happens_before` then builds the happens-before relation a device would obey
(program order per stream, event record -> wait edges, work waits, host waits) and reports every pair
of conflicting accesses to one buffer that it leaves unordered.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvpp_fx.runtime.device import DeviceAPI


class RecordingStream:
    def __init__(self, api: RecordingDeviceAPI, name: str) -> None:
        self.api, self.name = api, name

    def wait_event(self, event: RecordingEvent) -> None:
        if self.name not in self.api.drop_waits_on:
            self.api.log.append(("wait_event", self.name, event.ident))


class RecordingEvent:
    def __init__(self, api: RecordingDeviceAPI, ident: int) -> None:
        self.api, self.ident = api, ident

    def record(self, stream: RecordingStream | None = None) -> None:
        stream = stream if stream is not None else self.api.current_stream()
        self.api.log.append(("record", stream.name, self.ident))

    def synchronize(self) -> None:
        self.api.log.append(("host_wait_event", None, self.ident))


class RecordingDeviceAPI(DeviceAPI):
    """The real API's interface over CPU; ``drop_waits_on`` names streams whose event waits are lost."""

    orders_streams = True  # CPU, but every stream and event call is what the checker reads

    def __init__(self, drop_waits_on: tuple[str, ...] = ()) -> None:
        super().__init__("cpu")
        self.drop_waits_on = set(drop_waits_on)
        self.log: list[tuple] = []
        self._ids = itertools.count()
        self._compute = RecordingStream(self, "compute")
        self._current = [self._compute]
        self._streams = 0
        self._works: dict[int, tuple[Any, int]] = {}  # id(work) -> (work, record id); keeps works alive

    def new_stream(self) -> RecordingStream:
        self._streams += 1  # the runtime creates its transfer stream first
        return RecordingStream(self, "transfer" if self._streams == 1 else f"side{self._streams}")

    def current_stream(self) -> RecordingStream:
        return self._current[-1]

    def new_event(self) -> RecordingEvent:
        return RecordingEvent(self, next(self._ids))

    @contextlib.contextmanager
    def stream(self, stream: RecordingStream):
        self._current.append(stream)
        try:
            yield stream
        finally:
            self._current.pop()

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> Any:
        work = super().broadcast(tensor, src, group)
        mode = "read" if src == dist.get_rank() else "write"
        work_id = next(self._ids)
        self._works[id(work)] = (work, work_id)
        self.log.append(("collective", self.current_stream().name, work_id, buffer_of(tensor), mode))
        return work

    def all_reduce_max(self, tensor: torch.Tensor, group: Any) -> Any:
        work = super().all_reduce_max(tensor, group)
        work_id = next(self._ids)
        self._works[id(work)] = (work, work_id)
        self.log.append(("collective", self.current_stream().name, work_id, buffer_of(tensor), "write"))
        return work

    def wait_work(self, work: Any, timeout: Any) -> None:
        # A device's Work.wait orders the current stream after the collective; the host does not wait.
        self.log.append(("wait_work", self.current_stream().name, self._works[id(work)][1]))
        work.wait(timeout)  # on this CPU host the bytes must still land before the test reads them

    def host_wait_work(self, work: Any, timeout: Any) -> None:
        self.log.append(("host_wait_work", None, self._works[id(work)][1]))
        work.wait(timeout)

    def gather_blocks(self, source: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        self.access(source, "read", "gather reads the owner's blocks")
        self.access(out, "write", "gather writes the owner's slot")
        super().gather_blocks(source, ids, out)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.access(src, "read", "copy reads a prefetched chunk")
        self.access(dst, "write", "copy writes the workspace")
        super().copy(dst, src)

    def access(self, tensor: torch.Tensor, mode: str, what: str) -> None:
        """Log a kernel on the current stream that reads and/or writes `tensor`'s buffer."""
        self.log.append(("access", self.current_stream().name, None, buffer_of(tensor), mode, what))


def buffer_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@dataclass
class _Op:
    index: int
    stream: str
    clock: dict[str, int]
    buffer: int
    mode: str
    what: str = ""


@dataclass
class OrderingReport:
    races: list[str] = field(default_factory=list)
    accesses: int = 0
    collectives: int = 0


def check_happens_before(log: list[tuple]) -> OrderingReport:
    """Every two accesses to one buffer, one of them a write, must be ordered by happens-before."""
    ops, report = _replay(log)
    by_buffer: dict[int, list[_Op]] = {}
    for op in ops:
        by_buffer.setdefault(op.buffer, []).append(op)
    for buffer_ops in by_buffer.values():
        for i, first in enumerate(buffer_ops):
            for second in buffer_ops[i + 1:]:
                if first.mode == "read" and second.mode == "read":
                    continue
                if first.clock[first.stream] > second.clock.get(first.stream, 0):
                    report.races.append(f"{second.what} (log #{second.index}, {second.stream}) is not ordered "
                                        f"after {first.what} (log #{first.index}, {first.stream})")
    return report


def collectives_not_before(log: list[tuple], what: str) -> list[int]:
    """For each access whose description starts with `what`, in log order: how many collectives logged
    before it are not ordered before it (still in flight as far as its stream is concerned)."""
    ops, _ = _replay(log)
    collectives = [op for op in ops if op.stream.startswith("collective#")]
    return [sum(1 for c in collectives if c.index < op.index and op.clock.get(c.stream, 0) < c.clock[c.stream])
            for op in ops if op.what.startswith(what)]


def _replay(log: list[tuple]) -> tuple[list[_Op], OrderingReport]:
    """Each access and collective of `log` with its vector clock."""
    clocks: dict[str, dict[str, int]] = {}
    host: dict[str, int] = {}
    events: dict[int, dict[str, int]] = {}
    works: dict[int, dict[str, int]] = {}
    ops: list[_Op] = []
    report = OrderingReport()

    def merge(into: dict[str, int], other: dict[str, int]) -> None:
        for key, value in other.items():
            if into.get(key, 0) < value:
                into[key] = value

    def stream_clock(name: str) -> dict[str, int]:
        clock = clocks.setdefault(name, {})
        merge(clock, host)  # ops issued after a host wait follow what the host waited for
        return clock

    def tick(name: str) -> dict[str, int]:
        clock = stream_clock(name)
        clock[name] = clock.get(name, 0) + 1
        return dict(clock)

    for index, entry in enumerate(log):
        kind, stream = entry[0], entry[1]
        if kind == "record":
            events[entry[2]] = dict(stream_clock(stream))
        elif kind == "wait_event":
            merge(stream_clock(stream), events.get(entry[2], {}))
        elif kind == "collective":
            # A collective runs on the communicator's own stream: it follows what its issuing stream did
            # before it, but nothing issued later on that stream follows it without a work wait.
            name = f"collective#{entry[2]}"
            clock = dict(stream_clock(stream))
            clock[name] = 1
            works[entry[2]] = clock
            ops.append(_Op(index, name, clock, entry[3], entry[4], "broadcast"))
            report.collectives += 1
        elif kind == "wait_work":
            merge(stream_clock(stream), works[entry[2]])
        elif kind == "host_wait_work":
            merge(host, works[entry[2]])
        elif kind == "host_wait_event":
            merge(host, events.get(entry[2], {}))
        elif kind == "access":
            ops.append(_Op(index, stream, tick(stream), entry[3], entry[4], entry[5]))
            report.accesses += 1
        else:
            raise ValueError(f"unknown log entry {entry!r}")
    return ops, report
