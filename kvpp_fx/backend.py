"""`kvpp_backend`: a Dynamo backend that applies the KVPP passes, then runs or compiles the result.

    torch.compile(model, backend=kvpp_backend(plan, mode="piecewise", inner="aot_eager"))
    torch.compile(model, backend="kvpp", options={"plan": plan, "mode": "eager"})

- ``mode="eager"``: the rewritten GraphModule runs as is (``inner`` must be "eager").
- ``mode="piecewise"``: the graph is split at kvpp and cache ops; the eager pieces run as plain
  Python, every other piece is compiled by ``inner`` ("eager", "aot_eager", "inductor", "torchair" or
  any Dynamo backend callable).
- ``mode="full"`` is refused: a full graph would capture the cache ops and the broadcasts.
- ``specs``: the attention/cache ops the passes recognise (`AttentionOpSpec`s); by default, the specs
  of `kvpp_fx.passes.registry.default_specs` when the backend is built. With the plan's layer table
  they form the backend's frozen `PassConfig`, which every pass of every compile reads.
A model that Dynamo splits at graph breaks is fine: each graph holds a contiguous run of the plan's
layers, or one layer whose index is a run-time value when one compiled frame serves several layers
(docs/graph-contract.md). Graphs are written to ``dump_dir`` (or ``$KVPP_DUMP_DIR``): before and after
the pass, each piece, and an index.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._dynamo.backends.registry import lookup_backend, register_backend
from torch._dynamo.symbolic_convert import InstructionTranslator

from kvpp_fx.schedule import MSG_GRAPH_MODE, LayerSchedule
from kvpp_fx.passes.layers import GraphLayers
from kvpp_fx.passes.pass_config import PassConfig
from kvpp_fx.passes.registry import AttentionOpSpec
from kvpp_fx.passes.render import describe_pieces
from kvpp_fx.passes.manager import PassManager
from kvpp_fx.passes.split import SplitResult
from kvpp_fx.runtime.current import active_runtime
from kvpp_fx.runtime.graph_ops import RoutedOp

logger = logging.getLogger(__name__)

GRAPH_MODES = ("eager", "piecewise")  # the graph modes the backend runs; "full" is refused
DUMP_ENV = "KVPP_DUMP_DIR"


class TorchairNotInstalledError(ImportError):
    """``inner="torchair"`` needs Ascend's torchair package."""


class KVPPBackendError(ValueError):
    """Bad kvpp_backend options."""


class PlanChangedError(RuntimeError):
    """A graph compiled for one runtime's plan runs under a runtime with another plan."""


def may_hold_part_of_the_model(gm: torch.fx.GraphModule) -> bool:
    """False when Dynamo traces this graph with ``fullgraph=True``: the compiled function is then one graph,
    which must hold every target layer. Otherwise graph breaks may have split the model into several
    graphs (Dynamo may even compile each layer's frame on its own), each holding a run of the layers or
    none."""
    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # not called from Dynamo's tracing (a graph compiled later, or by hand)
        return True
    return tx is None or not getattr(tx, "one_graph", False)


@dataclass
class CompileRecord:
    """What one compile did: for tests, dumps and benchmarks, and for the engine that owns the backend
    and the runtime, which tells the runtime each graph's layers and routing (``layers``,
    ``owner_routed``): the backend does not reach into whichever runtime is active while it compiles."""

    mode: str
    layers: tuple[int, ...]
    graph_before: str
    graph_after: str
    pieces: list[tuple[str, str, str]] = field(default_factory=list)  # (name, kind, code)
    piece_summary: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    dump_dir: Path | None = None
    owner_routed: bool = False  # the route pass routed the cache ops: the graph serves owner mode too
    run_time_layer: bool = False  # one graph for several layers: its layer is a run-time value (`layers` empty)

    def routed_layers(self, target_layers: Sequence[int]) -> tuple[tuple[int, ...], bool]:
        """What the owner of the backend and the runtime tells the runtime (``note_routing(*...)``): the
        layers this graph serves, and whether they are routed for owner mode. A graph whose layer is a
        run-time value may serve any target layer, and is never routed: owner mode is then refused before
        anything moves."""
        if self.run_time_layer:
            return tuple(target_layers), False
        return self.layers, self.owner_routed


def resolve_inner(inner: str | Callable) -> Callable:
    if callable(inner):
        return inner
    if inner == "torchair":
        try:
            torchair = importlib.import_module("torchair")
        except ImportError:
            raise TorchairNotInstalledError(
                "inner='torchair' needs Ascend's torchair package (with torch_npu), which is not installed."
            ) from None
        return torchair.get_npu_backend()
    if inner == "eager":
        return lambda gm, example_inputs: gm
    try:
        return lookup_backend(inner)
    except Exception as exc:
        raise KVPPBackendError(f"unknown inner backend {inner!r}: {exc}") from None


class _CompiledPiece(torch.nn.Module):
    def __init__(self, fn: Callable, unwrap_single: bool) -> None:
        super().__init__()
        self.fn = fn
        self.unwrap_single = unwrap_single

    def forward(self, *args: Any) -> Any:
        out = self.fn(*args)
        return out[0] if self.unwrap_single else out


class _TracedPiece(torch.nn.Module):
    """Records a span per call on the timeline of the current runtime, when it has one."""

    def __init__(self, inner: torch.nn.Module, name: str, kind: str) -> None:
        super().__init__()
        self.inner = inner
        self.label = f"{kind} {name}"
        self.kind = kind

    def forward(self, *args: Any) -> Any:
        runtime = active_runtime()
        timeline = runtime.timeline if runtime is not None else None
        if timeline is None:
            return self.inner(*args)
        with timeline.span(self.label, f"piece:{self.kind}"):
            return self.inner(*args)


def _trace_pieces(split: SplitResult) -> None:
    for piece in split.pieces:
        split.split_gm.add_submodule(piece.name, _TracedPiece(getattr(split.split_gm, piece.name), piece.name,
                                                              piece.kind))


def _make_tuple_output(gm: torch.fx.GraphModule) -> bool:
    """AOT backends want tuple outputs; split_module returns a bare value for a single output."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return False
    output.args = ((output.args[0],),)
    gm.recompile()
    return True


class KVPPBackend:
    """The Dynamo backend object returned by `kvpp_backend`."""

    _counter = itertools.count()

    def __init__(self, plan_or_schedule: Any, *, mode: str = "eager", inner: str | Callable = "eager",
                 dump_dir: str | os.PathLike | None = None, names: dict[str, int] | None = None,
                 first_prefetch: str = "entry", specs: Iterable[AttentionOpSpec] | None = None) -> None:
        if mode == "full":
            raise ValueError(MSG_GRAPH_MODE)
        if mode not in GRAPH_MODES:
            raise KVPPBackendError(f"mode must be one of {GRAPH_MODES} (or 'full', which KVPP refuses), "
                                   f"got {mode!r}.")
        if mode == "eager" and inner != "eager":
            raise KVPPBackendError(
                f"mode='eager' runs the rewritten graph as is and compiles nothing, so inner={inner!r} would be "
                "ignored; use mode='piecewise' to compile the pieces with it, or inner='eager'.")
        self.config = PassConfig.build(plan_or_schedule, specs=specs, names=names, first_prefetch=first_prefetch)
        self.passes = PassManager.for_mode(self.config, mode, RoutedOp)
        self.mode = mode
        self.inner_name = inner if isinstance(inner, str) else getattr(inner, "__name__", repr(inner))
        self.inner = resolve_inner(inner)
        env_dump = os.environ.get(DUMP_ENV)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else (Path(env_dump) if env_dump else None)
        self.records: list[CompileRecord] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 layers: GraphLayers | None = None) -> Callable:
        """Dynamo's backend call. `layers`: the graph's registered ops as the caller read them already
        (the vLLM integration, which chose the schedule by them); read by the pipeline otherwise."""
        before = gm.code  # Dynamo's graph, as captured (Dynamo's lazy codegen runs here)
        start = time.perf_counter()
        run = self.passes.run(gm, graph_breaks=may_hold_part_of_the_model(gm), layers=layers)
        inserted, routing, split, timings = run.inserted, run.routing, run.split, run.timings
        record = CompileRecord(self.mode, inserted.layers, before, gm.code, timings=timings,
                               owner_routed=bool(routing and routing.routed), run_time_layer=inserted.run_time_layer)
        compiled: Callable = gm
        if split is not None:
            record.pieces = [(p.name, p.kind, p.graph_module.code) for p in split.pieces]
            record.piece_summary = describe_pieces(split.pieces)
            inner_start = time.perf_counter()
            compiled = self._compile_pieces(split, example_inputs)
            _trace_pieces(split)
            timings["inner_compile_s"] = time.perf_counter() - inner_start
        timings["total_s"] = time.perf_counter() - start
        self.records.append(record)
        if self.dump_dir is not None:
            record.dump_dir = self._dump(record)
        return compiled

    def _compile_pieces(self, split: SplitResult, example_inputs: Sequence[Any]) -> Callable:
        if self.inner_name == "eager":
            return split.split_gm
        compiled_names = {p.name for p in split.pieces if not p.is_eager}
        inner = self.inner
        fake_mode = torch._guards.detect_fake_mode(example_inputs) or torch._subclasses.FakeTensorMode()
        fake_inputs = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]

        class PieceCompiler(torch.fx.Interpreter):
            def call_module(self, target, args, kwargs):
                submod = self.fetch_attr(target)
                if target not in compiled_names:
                    return submod(*args, **kwargs)
                single = _make_tuple_output(submod)
                out = submod(*args, **kwargs)
                split.split_gm.add_submodule(target, _CompiledPiece(inner(submod, list(args)), single))
                return out[0] if single else out

        with fake_mode:
            PieceCompiler(split.split_gm).run(*fake_inputs)
        return split.split_gm

    def _dump(self, record: CompileRecord) -> Path:
        root = self.dump_dir
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            root = root / f"rank{torch.distributed.get_rank()}"
        out = root / f"graph_{next(self._counter):03d}"
        out.mkdir(parents=True, exist_ok=True)
        files = [("before_pass.py", "the Dynamo graph as captured", record.graph_before),
                 ("after_pass.py", "after the KVPP insert pass", record.graph_after)]
        for i, (name, kind, code) in enumerate(record.pieces):
            files.append((f"piece_{i:02d}_{kind}_{name}.py", f"{kind} piece {name}", code))
        for filename, _, code in files:
            (out / filename).write_text(code.lstrip("\n"))
        index = {"mode": record.mode, "layers": list(record.layers), "owner_routed": record.owner_routed,
                 "run_time_layer": record.run_time_layer, "timings_s": record.timings,
                 "files": [{"file": f, "what": what} for f, what, _ in files]}
        (out / "index.json").write_text(json.dumps(index, indent=2))
        logger.info("KVPP graph dump written to %s", out)
        return out


def kvpp_backend(plan_or_schedule: Any, *, mode: str = "eager", inner: str | Callable = "eager",
                 dump_dir: str | os.PathLike | None = None, names: dict[str, int] | None = None,
                 first_prefetch: str = "entry", specs: Iterable[AttentionOpSpec] | None = None) -> KVPPBackend:
    """A Dynamo backend that rewrites the graph for KVPP (see the module docstring)."""
    return KVPPBackend(plan_or_schedule, mode=mode, inner=inner, dump_dir=dump_dir, names=names,
                       first_prefetch=first_prefetch, specs=specs)


@register_backend(name="kvpp")
def _kvpp_registered(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None):
    """``backend="kvpp"``: options come from ``torch.compile(..., options={...})`` or the current runtime."""
    options = dict(options or {})
    plan = options.pop("plan", None) or options.pop("schedule", None)
    if plan is None:
        runtime = active_runtime()
        if runtime is None:
            raise KVPPBackendError(
                "backend='kvpp' needs options={'plan': ...} or a compile inside `runtime.forward(...)`.")
        plan = runtime.plan
        compiled = _registered_backend(plan, options)(gm, example_inputs)
        return _same_plan_guard(compiled, plan)
    return _registered_backend(plan, options)(gm, example_inputs)


def _registered_backend(plan: Any, options: dict) -> KVPPBackend:
    unknown = set(options) - {"mode", "inner", "dump_dir", "names", "specs"}
    if unknown:
        raise KVPPBackendError(f"unknown kvpp backend options: {sorted(unknown)}.")
    return kvpp_backend(plan, **options)


def _same_plan_guard(compiled: Callable, plan: Any) -> Callable:
    """Dynamo does not guard on the runtime that was active at compile time, so the compiled graph checks,
    each call, that it runs under a runtime with the plan it was rewritten for."""
    baked = LayerSchedule.coerce(plan)

    def run(*args: Any) -> Any:
        runtime = active_runtime()
        if runtime is not None and runtime.plan is not plan:
            current = LayerSchedule.coerce(runtime.plan)
            if (current.target_layers, current.draft_layers, current.depth) != \
                    (baked.target_layers, baked.draft_layers, baked.depth):
                raise PlanChangedError(
                    f"this graph was rewritten for the plan of the runtime active when it compiled (targets "
                    f"{list(baked.target_layers)}, depth {baked.depth}); the current runtime's plan has targets "
                    f"{list(current.target_layers)}, depth {current.depth}. Call torch._dynamo.reset() or pass "
                    "options={'plan': ...}.")
        return compiled(*args)

    return run


