"""The KVPP pass pipeline, as vLLM runs its own: pass objects, one manager, one uuid.

Invariant: every compile with KVPP on (`kvpp_backend` in any mode, vLLM's mode 3) runs a `PassManager`
over one `PassConfig`: insert, route, (piecewise) split, verify, codegen, in that order, each timed.
A pass's ``uuid()`` hashes its source file and its configuration (vLLM's ``InductorPass.uuid``); the
manager's hashes the config and every pass's, so two pipelines that may rewrite a graph differently
never share a uuid. vLLM's compile cache is keyed by the pipeline's sources (`source_uuid`, which the
plugin computes in vLLM's engine process without importing torch) and by the config it hashes anyway.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx

from kvpp_fx.passes.insert import InsertResult, insert_kvpp_ops
from kvpp_fx.passes.pass_config import PassConfig
from kvpp_fx.passes.route import RouteResult, route_owner_ops
from kvpp_fx.passes.sources import file_uuid
from kvpp_fx.passes.split import SplitResult, split_pieces
from kvpp_fx.passes.verify import verify_graph


@dataclass
class PassRun:
    """What one run of the pipeline has produced so far, by pass name, and how long each pass took."""

    graph_breaks: bool
    results: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def inserted(self) -> InsertResult:
        return self.results["insert"]

    @property
    def routing(self) -> RouteResult | None:
        return self.results.get("route")

    @property
    def split(self) -> SplitResult | None:
        return self.results.get("split")


class KVPPPass:
    """One pass: ``name``, a call that changes the GraphModule in place and returns its result."""

    name: str = ""
    implementation: Callable[..., Any] | None = None  # the function whose file holds the pass's rewrite

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, run: PassRun) -> Any:
        raise NotImplementedError

    def configuration(self) -> str:
        """What, beyond the shared `PassConfig`, decides what this pass does."""
        return ""

    def uuid(self) -> str:
        source = file_uuid(Path(inspect.getsourcefile(self.implementation or type(self))))
        return hashlib.sha256(f"{type(self).__qualname__}|{source}|{self.configuration()}".encode()).hexdigest()


class InsertPass(KVPPPass):
    name = "insert"
    implementation = staticmethod(insert_kvpp_ops)

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, run: PassRun) -> InsertResult:
        return insert_kvpp_ops(gm, config, graph_breaks=run.graph_breaks)


class RoutePass(KVPPPass):
    """Routes only a graph the insert pass rewrote: a graph that already held kvpp ops keeps its routing.
    ``routed_op`` makes the graph target of a routed op (the runtime's `RoutedOp`): the passes do not
    import the runtime."""

    name = "route"
    implementation = staticmethod(route_owner_ops)

    def __init__(self, routed_op: Callable[..., Any]) -> None:
        self.routed_op = routed_op

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, run: PassRun) -> RouteResult | None:
        return route_owner_ops(gm, config, self.routed_op) if run.inserted.changed else None

    def configuration(self) -> str:
        return f"{self.routed_op.__module__}.{self.routed_op.__qualname__}"


class SplitPass(KVPPPass):
    name = "split"
    implementation = staticmethod(split_pieces)

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, run: PassRun) -> SplitResult:
        split = split_pieces(gm)
        run.timings.update({f"split_{k}": v for k, v in split.timings.items()})
        return split


class VerifyPass(KVPPPass):
    name = "verify"
    implementation = staticmethod(verify_graph)

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, run: PassRun) -> None:
        verify_graph(gm, config, run.split.pieces if run.split is not None else ())


class CodegenPass(KVPPPass):
    """Writes ``gm.code`` once, after the passes changed the graph: what eager mode runs, and the dump."""

    name = "codegen"

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, run: PassRun) -> str | None:
        if not run.inserted.changed:
            return None
        gm.recompile()
        return gm.code  # a lazy GraphModule writes its code on first access: part of codegen's time


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """The passes create some ten thousand nodes, stamps and names; a cyclic collection of the whole heap
    (Dynamo's and torch's objects included) in the middle costs more than the passes themselves. Paused
    for the run, as vLLM pauses it around CUDA-graph capture; nothing is kept that refcounting frees."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class PassManager:
    """Runs its passes in order over one config; ``uuid()`` names the whole pipeline."""

    def __init__(self, config: PassConfig, passes: Sequence[KVPPPass]) -> None:
        names = [p.name for p in passes]
        if len(set(names)) != len(names) or names[:1] != ["insert"]:
            raise ValueError(f"a KVPP pipeline starts with the insert pass and names each pass once, got {names}.")
        self.config = config
        self.passes = tuple(passes)

    @classmethod
    def for_mode(cls, config: PassConfig, mode: str, routed_op: Callable[..., Any]) -> PassManager:
        """The pipeline of `kvpp_backend`'s `mode`: piecewise splits the graph, eager does not."""
        passes: list[KVPPPass] = [InsertPass(), RoutePass(routed_op)]
        if mode == "piecewise":
            passes.append(SplitPass())
        return cls(config, [*passes, VerifyPass(), CodegenPass()])

    def run(self, gm: torch.fx.GraphModule, *, graph_breaks: bool) -> PassRun:
        run = PassRun(graph_breaks)
        with _collection_paused():
            for p in self.passes:
                start = time.perf_counter()
                run.results[p.name] = p(gm, self.config, run)
                run.timings[f"{p.name}_s"] = time.perf_counter() - start
        return run

    def uuid(self) -> str:
        parts = [self.config.uuid(), *(p.uuid() for p in self.passes)]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
