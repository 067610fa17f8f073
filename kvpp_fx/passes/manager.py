"""The KVPP pass pipeline, as vLLM runs its own: pass objects over one config, one manager.

Invariant: every compile with KVPP on (`kvpp_backend` in any mode, vLLM's mode 3) runs a `PassManager`
over one `PassConfig`: insert, route, (piecewise) split, verify, codegen, in that order, each timed.
Each pass declares what it reads (``reads``: the run's inputs, `RUN_INPUTS`, or what an earlier pass
produces; ``reads_if_produced``: read when this pipeline produces it) and the name it produces its
result under (``produces``); a pass is handed exactly what it declared. The manager refuses, when it is
built, a pipeline in which a pass reads what no earlier pass produces (`PassInputError`). The graph's
registered ops are read once per compile (`GraphLayers`): given to `run`, or read there before the
first pass. What keys vLLM's compile caches is the pipeline's source uuid (`kvpp_fx.passes.sources`),
computed in vLLM's engine process without torch, with vLLM's config hash, which covers the plan.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from kvpp_fx.passes.insert import InsertResult, insert_kvpp_ops
from kvpp_fx.passes.layers import GraphLayers
from kvpp_fx.passes.pass_config import PassConfig
from kvpp_fx.passes.route import RouteResult, route_owner_ops
from kvpp_fx.passes.split import SplitResult, split_pieces
from kvpp_fx.passes.verify import verify_graph

RUN_INPUTS = ("graph_breaks", "layers")  # what every run holds before its first pass


class PassInputError(ValueError):
    """A pass of a pipeline reads something that no earlier pass of the pipeline produces."""


@dataclass
class PassRun:
    """What one run of the pipeline holds: its inputs (`RUN_INPUTS`) and each pass's result, by the
    name the pass produces it under, and how long each step took."""

    values: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def inserted(self) -> InsertResult:
        return self.values["inserted"]

    @property
    def routing(self) -> RouteResult | None:
        return self.values.get("routing")

    @property
    def split(self) -> SplitResult | None:
        return self.values.get("split")


class KVPPPass:
    """One pass: ``name``, what it reads and produces, and a call that changes the GraphModule in place
    and returns its result. A result's name stands for what the pass wrote on the graph too (the
    insert pass's stamps are part of "inserted")."""

    name: str = ""
    reads: tuple[str, ...] = ()
    reads_if_produced: tuple[str, ...] = ()
    produces: str | None = None

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, inputs: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def timings(self, result: Any) -> dict[str, float]:
        """Timings of the pass's own steps, beside its total (``<name>_s``)."""
        return {}


class InsertPass(KVPPPass):
    name = "insert"
    reads = ("graph_breaks", "layers")
    produces = "inserted"

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, inputs: Mapping[str, Any]) -> InsertResult:
        return insert_kvpp_ops(gm, config, graph_breaks=inputs["graph_breaks"], layers=inputs["layers"])


class RoutePass(KVPPPass):
    """Routes only a graph the insert pass rewrote: a graph that already held kvpp ops keeps its routing.
    ``routed_op`` makes the graph target of a routed op (the runtime's `RoutedOp`): the passes do not
    import the runtime."""

    name = "route"
    reads = ("inserted",)
    produces = "routing"

    def __init__(self, routed_op: Callable[..., Any]) -> None:
        self.routed_op = routed_op

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, inputs: Mapping[str, Any]) -> RouteResult | None:
        return route_owner_ops(gm, config, self.routed_op) if inputs["inserted"].changed else None


class SplitPass(KVPPPass):
    """Splits at the ops the insert pass stamped."""

    name = "split"
    reads = ("inserted",)
    produces = "split"

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, inputs: Mapping[str, Any]) -> SplitResult:
        return split_pieces(gm)

    def timings(self, result: SplitResult) -> dict[str, float]:
        return {f"split_{k}": v for k, v in result.timings.items()}


class VerifyPass(KVPPPass):
    name = "verify"
    reads = ("layers",)
    reads_if_produced = ("split",)

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, inputs: Mapping[str, Any]) -> None:
        split = inputs.get("split")
        verify_graph(gm, config, split.pieces if split is not None else (), layers=inputs["layers"])


class CodegenPass(KVPPPass):
    """Writes ``gm.code`` once, after the passes changed the graph: what eager mode runs, and the dump."""

    name = "codegen"
    reads = ("inserted",)
    produces = "code"

    def __call__(self, gm: torch.fx.GraphModule, config: PassConfig, inputs: Mapping[str, Any]) -> str | None:
        if not inputs["inserted"].changed:
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
    """Runs its passes in order over one config, each handed what it declared it reads."""

    def __init__(self, config: PassConfig, passes: Sequence[KVPPPass]) -> None:
        names = [p.name for p in passes]
        if len(set(names)) != len(names):
            raise ValueError(f"a KVPP pipeline names each pass once, got {names}.")
        _check_inputs(passes)
        self.config = config
        self.passes = tuple(passes)

    @classmethod
    def for_mode(cls, config: PassConfig, mode: str, routed_op: Callable[..., Any]) -> PassManager:
        """The pipeline of `kvpp_backend`'s `mode`: piecewise splits the graph, eager does not."""
        passes: list[KVPPPass] = [InsertPass(), RoutePass(routed_op)]
        if mode == "piecewise":
            passes.append(SplitPass())
        return cls(config, [*passes, VerifyPass(), CodegenPass()])

    def run(self, gm: torch.fx.GraphModule, *, graph_breaks: bool, layers: GraphLayers | None = None) -> PassRun:
        """Run the passes on `gm`. `layers`: the compile's reading of its registered ops, when the caller
        read it already (the vLLM integration does, to choose the schedule); else it is read here, timed
        as ``resolve_s``."""
        run = PassRun({"graph_breaks": graph_breaks})
        with _collection_paused():
            if layers is None:
                start = time.perf_counter()
                layers = GraphLayers.read(gm.graph, self.config.matcher, self.config.schedule.names)
                run.timings["resolve_s"] = time.perf_counter() - start
            run.values["layers"] = layers.for_config(self.config)
            for p in self.passes:
                inputs = {name: run.values[name] for name in (*p.reads, *p.reads_if_produced) if name in run.values}
                start = time.perf_counter()
                result = p(gm, self.config, inputs)
                elapsed = time.perf_counter() - start
                run.timings.update(p.timings(result))
                run.timings[f"{p.name}_s"] = elapsed
                if p.produces is not None:
                    run.values[p.produces] = result
        return run


def _check_inputs(passes: Sequence[KVPPPass]) -> None:
    """Each pass reads only the run's inputs and what earlier passes produce (what it reads only if
    produced, no later pass produces either); no two passes produce one name."""
    producers: dict[str, str] = {}
    for p in passes:
        if p.produces is not None and producers.setdefault(p.produces, p.name) != p.name:
            raise PassInputError(f"passes {producers[p.produces]!r} and {p.name!r} both produce {p.produces!r}.")
    available = set(RUN_INPUTS)
    for p in passes:
        for name in p.reads:
            if name not in available:
                later = f" (the later pass {producers[name]!r} does)" if name in producers else ""
                raise PassInputError(f"pass {p.name!r} reads {name!r}, which no earlier pass of the pipeline "
                                     f"{[q.name for q in passes]} produces{later}.")
        for name in p.reads_if_produced:
            if name in producers and name not in available:
                raise PassInputError(f"pass {p.name!r} reads {name!r}, which the later pass {producers[name]!r} "
                                     "produces: it would run without it.")
        if p.produces is not None:
            available.add(p.produces)
