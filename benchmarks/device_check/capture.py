"""Breakable CUDA-graph capture with KVPP's eager segments, on one GPU.

vLLM's breakable capture (``VLLM_USE_BREAKABLE_CUDAGRAPH``, its default for DeepSeek-V3.2 and GLM-5 class
models, and what a user may set for any model) ends a CUDA graph at each eager break, runs the break's Python, begins
the next graph, and
replays graph segments and breaks in order. KVPP records a target layer's MLA cache write as a break
(`kvpp_fx.integrations.vllm.attention.model_hooks`), so each replayed step writes through its own slot mapping; a write
left inside a graph segment replays the capture's.

The check captures one layer's step with real CUDA graphs: the new rows from a static input (graph), the
layer's cache write (KVPP's break), a read of the cache (graph). It replays two steps, each with its own
input and slot mapping: the cache must hold each step's rows at that step's positions, and the graphed read
must see them. The control captures the same layer without KVPP's hook: its write is inside the graph and
replays the capture's positions, which the same comparison must catch.

The device machine carries no vLLM. Where vLLM is missing, the two names the hook reads, vLLM's capture slot
(``BreakableCUDAGraphCapture``) and ``get_attention_context``, are stand-ins with vLLM 0.32's semantics
(`install_standins`), and the result says so.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from typing import Any

import torch

RECORD = 8  # values per cache row
ROWS = 4  # new rows (tokens) per step
CACHE_ROWS = 32


class StandInCapture:
    """vLLM 0.32's ``BreakableCUDAGraphCapture``: real CUDA graph segments, eager breaks between them."""

    _tls = threading.local()

    @classmethod
    def current(cls) -> StandInCapture | None:
        return getattr(cls._tls, "active", None)

    def __init__(self, pool: Any = None) -> None:
        self.pool, self.segments, self._graph, self._capturing = pool, [], None, False

    def __enter__(self) -> StandInCapture:
        StandInCapture._tls.active = self
        self._begin()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._end()
        finally:
            StandInCapture._tls.active = None

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)
        self._capturing = True

    def _end(self) -> None:
        if self._capturing:
            self._graph.capture_end()
            self.segments.append(self._graph.replay)
            self._capturing = False

    def add_eager(self, fn: Any) -> Any:
        self._end()
        result = fn()
        self.segments.append(fn)
        self._begin()
        return result

    def replay(self) -> None:
        for segment in self.segments:
            segment()


class StandInContext:
    """The part of vLLM's forward context the cache write reads: the layer, its cache, the step's slots."""

    current: StandInContext | None = None

    def __init__(self, layers: dict[str, Any], slot_mapping: dict[str, torch.Tensor]) -> None:
        self.layers, self.slot_mapping = layers, slot_mapping


def _get_attention_context(layer_name: str) -> tuple[Any, Any, torch.Tensor, torch.Tensor | None]:
    context = StandInContext.current
    layer = context.layers[layer_name]
    return None, layer, layer.kv_cache, context.slot_mapping.get(layer_name)


def install_standins() -> str:
    """vLLM's module names the hook imports, as stand-ins, where vLLM is not installed; says which ran."""
    if importlib.util.find_spec("vllm") is not None:
        return "vLLM's BreakableCUDAGraphCapture and forward context"
    names = {"vllm.compilation.breakable_cudagraph": {"BreakableCUDAGraphCapture": StandInCapture},
             "vllm.model_executor.layers.attention.attention": {"get_attention_context": _get_attention_context}}
    for name, attributes in names.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        sys.modules[name].__dict__.update(attributes)
    return "stand-ins for vLLM's capture slot and forward context (vLLM is not installed here)"


def capture_worker(rank: int, world: int, device_type: str) -> dict[str, Any]:
    """Rank 0 alone: KVPP's hooked layer and the control, each captured once and replayed for two steps."""
    if rank != 0:
        return {}
    if device_type != "cuda":
        return {"skipped": "CUDA graphs need a GPU (make test records the same breaks with a stand-in capture)"}
    which = install_standins()
    device = torch.device("cuda", 0)
    out = {"capture": which}
    for name, hooked in (("kvpp", True), ("control", False)):
        out[name] = _captured_steps(device, hooked)
    return out


def _captured_steps(device: torch.device, hooked: bool) -> dict[str, Any]:
    from kvpp_fx.integrations.vllm.setup.config import KVPPConfig
    from kvpp_fx.integrations.vllm.attention import model_hooks
    from kvpp_fx.integrations.vllm.engine.state import EngineState
    from kvpp_fx.runtime.graph_ops import passthrough

    class MLA(torch.nn.Module):  # vLLM's MLAAttention.update_kv_cache, less the backends' kernels
        layer_name = LAYER

        def update_kv_cache(self, kv_c_normed, k_pe, kv_cache, slot_mapping, attn_metadata, kv_cache_dtype,
                            k_scale):
            kv_cache.view(-1, RECORD).index_copy_(0, slot_mapping, torch.cat([kv_c_normed, k_pe], -1))

    layer = MLA()
    layer.kv_cache = torch.zeros(CACHE_ROWS // 4, 4, RECORD, device=device)
    if hooked:
        layer._kvpp_engine, layer._kvpp_layer = EngineState(KVPPConfig(enable_kvpp=True, tp=2), None), 0
        layer.__class__ = model_hooks.waiting_class(MLA, True)
    capture_cls, context = _capture_and_context(layer)
    x = torch.zeros(ROWS, RECORD, device=device)  # the step's static input buffer
    after = torch.zeros(ROWS, RECORD, device=device)  # a graph segment after the write
    vllm_slots = torch.arange(ROWS, device=device)  # vLLM's static slot-mapping buffer, refilled each step

    def step() -> None:
        new = x * 2.0
        slots = get_slots()
        layer.update_kv_cache(new[:, : RECORD - 2], new[:, RECORD - 2:], layer.kv_cache, slots, None, "auto", None)
        after.copy_(x + 1.0)

    def get_slots() -> torch.Tensor:  # what vLLM's op passes: the forward context's slot mapping for the layer
        from vllm.model_executor.layers.attention.attention import get_attention_context

        return get_attention_context(LAYER)[3]

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), passthrough(), context(vllm_slots):
        step()  # warm-up, outside any capture
        with capture_cls() as capture:
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    steps = []
    # Each step: vLLM's own positions (its static buffer, refilled) and KVPP's remapped ones (a new tensor in
    # the forward context, as `packed_metadata.rebind` gives a non-owned layer of a packed step).
    for i, (pool, packed) in enumerate((([9, 17, 3, 30], [0, 2, 1, 3]), ([21, 5, 12, 26], [3, 1, 0, 2]))):
        layer.kv_cache.zero_()
        x.copy_(torch.arange(ROWS, device=device).unsqueeze(1).expand(ROWS, RECORD) + 10.0 * (i + 1))
        vllm_slots.copy_(torch.tensor(pool, device=device))
        with torch.cuda.stream(stream), context(torch.tensor(packed, device=device)):
            capture.replay()
        torch.cuda.synchronize(device)
        rows = layer.kv_cache.view(-1, RECORD)
        written = rows.abs().sum(-1).nonzero().flatten().tolist()
        steps.append({"written": written, "expected": sorted(packed),
                      "values_ok": bool(torch.equal(rows[packed], 2.0 * x)),  # row j of the step at packed[j]
                      "graphs_ok": bool(torch.equal(after, x + 1.0))})
    return {"eager_breaks": sum(1 for s in capture.segments if not _is_graph_replay(s)), "steps": steps,
            "ok": all(s["written"] == s["expected"] and s["values_ok"] and s["graphs_ok"] for s in steps)}


LAYER = "model.layers.0.self_attn.attn"


def _is_graph_replay(segment: Any) -> bool:
    return isinstance(getattr(segment, "__self__", None), torch.cuda.CUDAGraph)


def _capture_and_context(layer: Any):
    """vLLM's capture class, and a context manager that makes `slots` the step's slot mapping for `layer`,
    as the hook and vLLM's op read it."""
    import contextlib

    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    if BreakableCUDAGraphCapture is StandInCapture:
        @contextlib.contextmanager
        def context(slots: torch.Tensor):
            previous = StandInContext.current
            StandInContext.current = StandInContext({LAYER: layer}, {LAYER: slots})
            try:
                yield
            finally:
                StandInContext.current = previous
    else:
        from vllm.forward_context import ForwardContext, override_forward_context

        @contextlib.contextmanager
        def context(slots: torch.Tensor):
            with override_forward_context(ForwardContext(no_compile_layers={LAYER: layer},
                                                         attn_metadata={LAYER: None}, slot_mapping={LAYER: slots})):
                yield
    return BreakableCUDAGraphCapture, context
