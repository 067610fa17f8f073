"""vLLM's compiled paths: the kvpp backend of modes 1 and 2, and the ``VllmBackend`` of mode 3.

Invariant, in both: a graph of the target model gets the engine plan's kvpp ops (the layer schedule is
the plan's, so slots agree with the eager path and the runtime); a graph holding only MTP layers (the
drafter's) gets none, since drafts stay local; a graph compiled with KVPP on but outside a KVPP
engine's model runner is an error, never a graph without ops.

- Modes 1 and 2: ``compilation_config.backend`` is ``kvpp_fx.integrations.vllm.backend``
  (`kvpp_vllm_backend`): the kvpp backend in piecewise mode, whose pieces between the kvpp and MLA ops
  are compiled by ``additional_config.kvpp_fx.inner_backend`` (inductor with vLLM's
  ``inductor_compile_config``, as vLLM would have compiled the whole graph).
- Mode 3: KVPP workers make vLLM build `kvpp_vllm_backend_class` in place of its ``VllmBackend``
  (`install_vllm_backend`). Its ``__call__`` rewrites the whole Dynamo graph in place (no input added
  or removed; every new node carries Dynamo's ``meta["example_value"]``, which vLLM's split reads),
  then runs vLLM's own: the split at ``splitting_ops`` (which hold the kvpp ops, see `compile_modes`),
  per-piece compilation, piecewise CUDA graphs. A graph that already holds kvpp ops (vLLM reloading
  its own AOT artifact) is verified, not rewritten. In a process without a KVPP engine running, the
  subclass is vLLM's backend exactly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx

from kvpp_fx.backend import KVPPBackend
from kvpp_fx.integrations.vllm.setup.compile_modes import inner_backend
from kvpp_fx.integrations.vllm.engine.state import EngineState, current_engine
from kvpp_fx.schedule import LayerSchedule
from kvpp_fx.passes.layers import GraphLayers
from kvpp_fx.passes.registry import VLLM_SPECS, AttentionOpSpec, OpMatcher

logger = logging.getLogger(__name__)

_INSTALLED = "_kvpp_fx_backend"


class KVPPCompileError(RuntimeError):
    """The kvpp backend cannot tell which engine's plan a graph belongs to."""


def graph_layers(gm: torch.fx.GraphModule, specs: tuple[AttentionOpSpec, ...] = VLLM_SPECS) -> dict[str, int]:
    """Name -> index of every layer the graph's registered ops name: vLLM's MLA/SFA ops, matched and read
    as the passes read them (`GraphLayers`)."""
    return GraphLayers.read(gm.graph, OpMatcher(specs)).layer_names()


def schedule_for(names: dict[str, int], plan: Any | None, plan_names: dict[str, int] | None = None) -> LayerSchedule:
    """The schedule the pass uses for a graph reading the layers `names`, under an engine's plan (None:
    KVPP off). Layer names come from graph inputs, which Dynamo does not guard, so the schedule always
    carries the name map."""
    layers = tuple(sorted(set(names.values())))
    if plan is None:
        return LayerSchedule(target_layers=(), draft_layers=layers, names=names)
    if layers and set(layers) <= set(plan.local_draft_layers):
        return LayerSchedule(target_layers=(), draft_layers=layers, depth=plan.depth, names=plan_names or names)
    unknown = sorted(set(layers) - set(plan.target_layers) - set(plan.local_draft_layers))
    if unknown:
        raise KVPPCompileError(f"the graph reads layers {unknown}, which the KVPP plan does not hold.")
    return LayerSchedule.from_plan(plan, plan_names)


def _engine_for_compile() -> EngineState | None:
    """The KVPP engine compiling now; None with KVPP off; an error when KVPP is on but no engine is."""
    state = current_engine()
    if state is None:
        _refuse_if_kvpp_on()
        return None
    if state.plan is None:
        raise KVPPCompileError("a graph was compiled before the engine's KVPP plan was built.")
    return state


@dataclass(frozen=True)
class GraphBackend:
    """The backend for one graph, what the graph is (``kind``: "target", "draft" or "kvpp-off"), the layers
    its ops name, and the reading of its registered ops that chose the schedule, which the backend's
    passes take instead of reading the graph again (one layer resolution per compile)."""

    backend: KVPPBackend
    kind: str
    layers: tuple[int, ...]
    reading: GraphLayers

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        return self.backend(gm, example_inputs, layers=self.reading)


def _backend_for(state: EngineState | None, gm: torch.fx.GraphModule, mode: str,
                 inner: str | Callable = "eager", **options: Any) -> GraphBackend:
    plan = None if state is None else state.plan
    plan_names = dict(state.vplan.layer_index) if plan is not None else None
    reading = GraphLayers.read(gm.graph, OpMatcher(VLLM_SPECS), plan_names)
    names = reading.layer_names()
    schedule = schedule_for(names, plan, plan_names)
    kind = "target" if schedule.target_layers else ("draft" if state is not None else "kvpp-off")
    backend = KVPPBackend(schedule, mode=mode, inner=inner, specs=VLLM_SPECS, **options)
    return GraphBackend(backend, kind, tuple(sorted(set(names.values()))), reading)


def _inner_compiler(vllm_config: Any) -> str | Callable:
    name = inner_backend(vllm_config)
    if name != "inductor":
        return name
    patches = dict(vllm_config.compilation_config.inductor_compile_config)

    def inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=patches)

    return inductor


def kvpp_vllm_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]):
    """``compilation_config.backend`` of modes 1 and 2 (see the module docstring)."""
    state = _engine_for_compile()
    if state is None:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        inner = _inner_compiler(config) if config is not None else "inductor"
    else:
        inner = _inner_compiler(state.vllm_config)
    graph = _backend_for(state, gm, "piecewise", inner)
    logger.info("KVPP: %s graph with layers %s, kvpp ops for %s, pieces compiled by %s.", graph.kind,
                list(graph.layers), list(graph.backend.config.schedule.target_layers), graph.backend.inner_name)
    compiled = graph(gm, example_inputs)
    if state is not None:
        state.counters.note_compiled_graph(graph.kind, graph.layers)
    return _compiled_each_start(compiled)


MSG_NOT_SAVED = (
    "kvpp-fx compiles its graphs again at every start (the compiled pieces call the engine's runtime), "
    "so this AOT artifact is not saved; the kvpp pass then runs on every load."
)


def _compiled_each_start(compiled: Callable) -> Callable:
    """vLLM's AOT compile (on by default) takes only serializable compiled functions. The kvpp backend's
    is one that refuses to be saved, so vLLM logs it and keeps it in memory; a load can then never
    skip the kvpp pass."""
    from torch._dynamo.aot_compile_types import SerializableCallable

    class CompiledEachStart(SerializableCallable):
        def __init__(self, fn: Callable) -> None:
            self.fn = fn

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.fn(*args, **kwargs)

        @classmethod
        def serialize_compile_artifacts(cls, fn: Any) -> bytes:
            raise KVPPCompileError(MSG_NOT_SAVED)

        @classmethod
        def deserialize_compile_artifacts(cls, data: bytes) -> Any:
            raise KVPPCompileError(MSG_NOT_SAVED)

    return CompiledEachStart(compiled)


@functools.cache
def kvpp_vllm_backend_class() -> type:
    """vLLM's ``VllmBackend`` with the kvpp insert pass run on the whole graph before its split."""
    from vllm.compilation.backends import VllmBackend

    base = getattr(VllmBackend, _INSTALLED, VllmBackend)

    class KVPPVllmBackend(base):  # type: ignore[misc, valid-type]
        def __call__(self, graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            state = _engine_for_compile()
            if state is not None:
                rewrite_whole_graph(state, graph, example_inputs)
            return super().__call__(graph, example_inputs)

    KVPPVllmBackend.__qualname__ = KVPPVllmBackend.__name__ = "KVPPVllmBackend"
    setattr(KVPPVllmBackend, _INSTALLED, base)
    return KVPPVllmBackend


def install_vllm_backend() -> None:
    """Make this process's vLLM build `kvpp_vllm_backend_class` wherever it builds a ``VllmBackend``:
    every such place imports the name from ``vllm.compilation.backends`` when it runs."""
    from vllm.compilation import backends

    backends.VllmBackend = kvpp_vllm_backend_class()


def rewrite_whole_graph(state: EngineState, gm: torch.fx.GraphModule, example_inputs: Any) -> None:
    """Mode 3: the insert and route passes and the verifier on vLLM's whole Dynamo graph, in place."""
    # vLLM's generated code calls each eager piece with its inputs, and a prefetch at graph entry
    # would be a piece without any: the first layer's prefetch joins its wait's piece instead.
    graph = _backend_for(state, gm, "eager", first_prefetch="at_first_wait")
    graph(gm, example_inputs)
    if graph.backend.records[-1].run_time_layer:  # its kvpp.enter_layer is not among vLLM's splitting ops
        raise KVPPCompileError("mode 3: a graph whose cache ops take their layer index as a run-time value "
                               "cannot be split by vLLM with the kvpp ops eager; vLLM's MLA ops name their "
                               "layer, so this graph comes from an op spec with layer_kind='index'.")
    for node in gm.graph.nodes:
        if "example_value" not in node.meta and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
    logger.info("KVPP: %s graph with layers %s, kvpp ops for %s, split and compiled by vLLM.", graph.kind,
                list(graph.layers), list(graph.backend.config.schedule.target_layers))
    state.counters.note_compiled_graph(graph.kind, graph.layers)


def _refuse_if_kvpp_on() -> None:
    """No engine is running: fine with KVPP off (the graph gets no kvpp ops); a bug with KVPP on."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return
    from kvpp_fx.integrations.vllm.setup.config import KVPPConfig

    config = get_current_vllm_config_or_none()
    if config is not None and KVPPConfig.from_vllm_config(config).enabled:
        raise KVPPCompileError("a graph was compiled with KVPP on outside a KVPP model runner's step; "
                               "no kvpp op would be placed.")
