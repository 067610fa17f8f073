"""Breakable CUDA graphs (vLLM's BreakableCUDAGraphCapture, stood in for where CUDA graphs are not): the
waits and the MLA cache write rerun on every replay.

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`: vLLM's import changes process-wide state; the name
keeps the main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import pytest
import torch

from tests.integrations.vllm.mla_specs import ON


class StandInCapture:
    """Stands in for vLLM's BreakableCUDAGraphCapture, which needs CUDA graphs (not on this host): it
    records eager segments as vLLM's does (run now, rerun on every replay) and replays only those."""

    _capturing = True

    def __init__(self):
        self.segments = []

    def add_eager(self, fn):  # vLLM's: end the segment, run fn outside any capture, record it, begin anew
        self._capturing = False
        try:
            result = fn()
        finally:
            self._capturing = True
        self.segments.append(fn)
        return result

    def replay(self):
        for fn in self.segments:
            fn()


def _breakable_model(runtime, num_layers):
    from kvpp_fx.integrations.vllm.attention import model_hooks
    from kvpp_fx.integrations.vllm.engine.state import Communication, EngineState

    class Attention(torch.nn.Module):
        def forward(self, x):
            return x + 1

    state = EngineState(ON, None, comm=Communication(runtime=runtime))
    layers = []
    for i in range(num_layers):
        module = Attention()
        module._kvpp_engine, module._kvpp_layer = state, i
        module.__class__ = model_hooks.waiting_class(Attention)
        layers.append(module)
    return state, layers


def test_under_breakable_cuda_graphs_the_waits_rerun_on_every_replay():
    """vLLM runs the model's Python once, at capture (a dummy run, in passthrough), and each replay reruns
    only the recorded segments: the waits must be eager segments, or a replayed step skips them."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    from kvpp_fx.integrations.vllm.attention import model_hooks
    from kvpp_fx.runtime.graph_ops import passthrough
    from kvpp_fx.runtime.errors import SkippedLayerError
    from kvpp_fx.runtime.runtime import KVPPRuntime
    from tests.passes import toy

    plan = toy.toy_plan(4)
    with KVPPRuntime.create(plan, toy.allocate(plan)) as runtime:
        state, layers = _breakable_model(runtime, 4)
        capture = StandInCapture()
        BreakableCUDAGraphCapture._tls.active = capture
        try:
            with passthrough():
                x = torch.zeros(2)
                for layer in layers:
                    x = layer(x)
        finally:
            BreakableCUDAGraphCapture._tls.active = None
        assert len(capture.segments) == 4
        for _ in range(3):  # three replayed steps: each awaits every layer, in plan order
            state.step.begin()
            with runtime.forward(has_history=False):
                capture.replay()
        assert runtime.stats()["forwards"] == 3
        # The control: a hook that waits in plain Python records nothing, so a replayed step skips them.
        plain = StandInCapture()
        BreakableCUDAGraphCapture._tls.active = plain
        try:
            with passthrough():
                for layer in layers:
                    model_hooks.await_layer(state, layer._kvpp_layer)
        finally:
            BreakableCUDAGraphCapture._tls.active = None
        assert plain.segments == []
        state.step.begin()
        with pytest.raises(SkippedLayerError), runtime.forward(has_history=False):
            plain.replay()


def test_under_breakable_cuda_graphs_the_mla_cache_write_reads_each_replayed_steps_slot_mapping():
    """vLLM records MLA attention as an eager segment but captures the MLA cache write (its unified op) with
    the capture's slot mapping, so a replayed packed step would write at pool positions while attention
    reads packed ones. Through vLLM's own cache-write op: KVPP records the wait, then the write, then
    vLLM's attention break, and the write reads each replayed step's forward context."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers.attention import mla_attention  # noqa: F401  (registers vLLM's MLA ops)
    from vllm.utils.torch_utils import _encode_layer_name

    from kvpp_fx.integrations.vllm.attention import model_hooks
    from kvpp_fx.integrations.vllm.engine.state import EngineState
    from kvpp_fx.runtime.graph_ops import passthrough

    name = "model.layers.0.self_attn.attn"
    cache = torch.zeros(4, 2, 3)  # 4 blocks of 2 tokens; a record of 2 + 1 values
    kv_c, k_pe = torch.ones(2, 2), torch.full((2, 1), 2.0)  # the capture's static buffers

    class MLA(torch.nn.Module):  # vLLM's MLAAttention, less the backends' kernels
        layer_name = name

        def prepare_kv_cache_update(self, attn_metadata):
            pass

        def update_kv_cache(self, kv_c_normed, k_pe, kv_cache, slot_mapping, attn_metadata, kv_cache_dtype, k_scale):
            kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping] = torch.cat([kv_c_normed, k_pe], -1)

        def forward(self):  # MLAAttention.forward where the attention op is opaque (CUDA, CPU)
            torch.ops.vllm.unified_mla_kv_cache_update(kv_c, k_pe, _encode_layer_name(name), "auto", torch.ones(()))
            BreakableCUDAGraphCapture.current().add_eager(lambda: None)  # vLLM's break at its attention op

    def context(slots, layer):
        return ForwardContext(no_compile_layers={name: layer}, attn_metadata={name: None}, slot_mapping={name: slots})

    def captured(layer):
        """The layer's step at capture (a dummy run, in passthrough, on the capture's slot mapping)."""
        capture = StandInCapture()
        BreakableCUDAGraphCapture._tls.active = capture
        try:
            with passthrough(), override_forward_context(context(torch.tensor([0, 1]), layer)):
                layer()
        finally:
            BreakableCUDAGraphCapture._tls.active = None
        return capture

    layer = MLA()
    layer._kvpp_engine, layer._kvpp_layer = EngineState(ON, None), 0
    layer.kv_cache = cache
    layer.__class__ = model_hooks.waiting_class(MLA, True)
    capture = captured(layer)
    assert [getattr(s, "func", None) for s in capture.segments] == [model_hooks.await_layer,
                                                                    model_hooks.replayed_cache_write, None]
    assert cache.view(-1, 3)[:2].eq(torch.tensor([1.0, 1.0, 2.0])).all()
    for step, slots in enumerate(([4, 5], [6, 2])):  # each replayed step writes where its own mapping says
        cache.zero_()
        kv_c.fill_(step + 3)  # the static input buffer, refilled by the step's graph segment
        with passthrough(), override_forward_context(context(torch.tensor(slots), layer)):
            capture.replay()
        written = cache.view(-1, 3).abs().sum(-1).nonzero().flatten().tolist()
        assert written == sorted(slots) and cache.view(-1, 3)[slots[0], 0] == step + 3
    # The control: vLLM's class writes in plain Python at capture and records only its attention break;
    # on a GPU its write stays inside the graph and replays the capture's positions.
    plain = MLA()
    plain.kv_cache = cache
    assert [getattr(s, "func", None) for s in captured(plain).segments] == [None]


def test_under_breakable_cuda_graphs_mla_layers_that_write_their_own_cache_keep_rows_off_the_owners():
    """vLLM's DeepSeek-V3.2 and GLM-5 attention (a subclass of MLAAttention with a forward of its own)
    writes its cache in a fused kernel of a captured segment, with vLLM's slot mapping: under breakable
    graphs such models keep decode rows on broadcast and whole-layer slots, where that mapping is right."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from kvpp_fx.integrations.vllm.attention.model_hooks import own_cache_writes_under_capture

    class FusedWriteAttention(MLAAttention):  # as DeepseekV32Attention (vLLM's CUDA build only)
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    assert own_cache_writes_under_capture({MLAAttention}, breakable=True) is None
    assert own_cache_writes_under_capture({FusedWriteAttention}, breakable=False) is None
    why = own_cache_writes_under_capture({MLAAttention, FusedWriteAttention}, breakable=True)
    assert "FusedWriteAttention" in why and "breakable CUDA graphs" in why


def test_an_sfa_models_owner_only_slots_need_every_token_routed_and_no_unskippable_cache_write():
    """Owner-only slots hold no layer, so a non-owner must write nothing there: an attention with a forward of its
    own (vLLM's CUDA DeepSeek-V3.2, eager too) and an indexer replayed by a breakable capture each keep whole-layer
    slots, and so does a sparse backend not declared to route every token as a decode row (a prefill step could
    not go to the owners). The control: the declared stand-in's plain MLAAttention, eager, has no hazard."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from kvpp_fx.integrations.vllm.attention.backends import BACKENDS, OwnerSupport, register_owner_backend
    from kvpp_fx.integrations.vllm.attention.model_hooks import owner_only_hazard

    class FusedWriteAttention(MLAAttention):  # as DeepseekV32Attention (vLLM's CUDA build only)
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    try:
        register_owner_backend("ROUTES_EVERY_TOKEN", OwnerSupport(True, "test", 16, sparse=True,
                                                                  routes_every_token=True))
        register_owner_backend("SPLITS_PREFILLS", OwnerSupport(True, "test", 64, sparse=True))
        assert owner_only_hazard({"ROUTES_EVERY_TOKEN"}, {MLAAttention}, breakable=False) is None
        why = owner_only_hazard({"ROUTES_EVERY_TOKEN", "SPLITS_PREFILLS"}, {MLAAttention}, breakable=False)
        assert "['SPLITS_PREFILLS'] are not declared to route every token as a decode row" in why
        why = owner_only_hazard({"ROUTES_EVERY_TOKEN"}, {FusedWriteAttention}, breakable=False)
        assert "FusedWriteAttention'] write their MLA cache in their own forward" in why
        why = owner_only_hazard({"ROUTES_EVERY_TOKEN"}, {MLAAttention}, breakable=True)
        assert "breakable CUDA graphs a non-owner's indexer runs inside the capture" in why
    finally:
        for name in ("ROUTES_EVERY_TOKEN", "SPLITS_PREFILLS"):
            BACKENDS.pop(name, None)


def test_breakable_graphs_are_a_hazard_only_where_vllm_captures_graphs():
    """vLLM sets VLLM_USE_BREAKABLE_CUDAGRAPH for DeepSeek-V3.2 on every platform, but captures only where it has
    capture sizes and a CUDA-graph mode: not on vLLM CPU (which clears the sizes) nor in eager engines."""
    import types

    from vllm.config import CUDAGraphMode

    from kvpp_fx.integrations.vllm.attention.model_hooks import captures_graphs

    def runner(sizes, mode):
        compilation = types.SimpleNamespace(cudagraph_capture_sizes=sizes, cudagraph_mode=mode)
        return types.SimpleNamespace(vllm_config=types.SimpleNamespace(compilation_config=compilation))

    assert captures_graphs(runner([1, 2, 4], CUDAGraphMode.FULL_AND_PIECEWISE))
    assert captures_graphs(runner([1, 2, 4], CUDAGraphMode.PIECEWISE))
    assert not captures_graphs(runner([], CUDAGraphMode.PIECEWISE))  # vLLM CPU
    assert not captures_graphs(runner([1, 2, 4], CUDAGraphMode.NONE))  # enforce_eager
