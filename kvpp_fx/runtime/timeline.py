"""A small span recorder that writes Chrome/Perfetto trace JSON (chrome://tracing, ui.perfetto.dev)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Timeline:
    """Thread-safe list of complete ("X") spans; one track per thread, one process per rank."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._thread_names: dict[int, str] = {}
        self._tracks: dict[str, int] = {}

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, cat, start, time.perf_counter_ns(), **args)

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, *, track: str | None = None,
            **args: Any) -> None:
        """One span on the calling thread's track, or on a named track (e.g. a stream) of its own."""
        if track is None:
            thread = threading.current_thread()
            tid, label = thread.ident, thread.name
        else:
            with self._lock:  # a numeric tid of its own (trace viewers want integers), stable per track
                tid = self._tracks.setdefault(track, 1_000_000_000 + len(self._tracks))
            label = track
        event = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid,
                 "ts": start_ns / 1000.0, "dur": (end_ns - start_ns) / 1000.0, "args": args}
        with self._lock:
            self._thread_names.setdefault(tid, label)
            self._events.append(event)

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def chrome_events(self) -> list[dict[str, Any]]:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        with self._lock:
            meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
                     for tid, name in self._thread_names.items()]
        return meta + self.events


def write_chrome_trace(path: str | os.PathLike, *timelines_events: list[dict[str, Any]]) -> Path:
    """Write the merged events of one or more ranks as a trace file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = [e for events in timelines_events for e in events]
    path.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}))
    return path
