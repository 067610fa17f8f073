"""The context gathers of vLLM's MLA prefill that KVPP streams from the owners (`context_stream`): which
gathers there are, a marked gather, and which impls read history through them.

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`: vLLM's import changes process-wide state; the name
keeps the main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import types

import pytest
import torch


def _ops_calls(source: str) -> set[str]:
    """The ``ops.<name>(...)`` calls in `source`."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(source))
    return {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "ops"}


def test_every_context_gather_of_vllms_mla_prefill_is_one_kvpp_streams():
    """The gathers ``_compute_prefill_context`` calls are the ones KVPP wraps (a vLLM that adds one would
    read a slot on the non-owners: `ContextStreamError` then, and this test names it first), and each is
    a function of ``vllm._custom_ops``. The control: the finder sees a call it is shown."""
    import inspect

    import vllm._custom_ops as custom_ops
    from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl

    from kvpp_fx.integrations.vllm.attention.context_stream import GATHERS

    calls = _ops_calls(inspect.getsource(MLACommonImpl._compute_prefill_context))
    assert calls == set(GATHERS), calls
    assert all(callable(getattr(custom_ops, name, None)) for name in GATHERS)
    assert _ops_calls("def f():\n    ops.new_gather(dst=x)\n    torch.cat(y)\n") == {"new_gather"}


def test_a_marked_gather_streams_from_the_owner_and_an_unmarked_one_is_vllms():
    """vLLM's CPU context gather, wrapped: inside a marked call it fills its rows through the layer's turn
    (a group of one: this rank owns the layer and gathers), counted as a streamed chunk; unmarked it is
    vLLM's own; called with arguments it does not take, it raises `ContextStreamError`."""
    import vllm._custom_ops as custom_ops

    from kvpp_fx.integrations.vllm.attention.context_stream import STREAMING, ChunkStream, wrap_gathers
    from kvpp_fx.runtime.errors import ContextStreamError
    from tests.support.specs import toy_spec
    from tests.support.toy_runtime import toy_runtime

    wrap_gathers()
    cache = torch.arange(4 * 16 * 8, dtype=torch.float32).view(4, 16, 8)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    call = dict(src_cache=cache, block_table=table, starts=torch.tensor([0], dtype=torch.int32),
                cu_seq_lens=torch.tensor([0, 20], dtype=torch.int32))
    expected = torch.cat([cache[2], cache[0, :4]])
    unmarked = torch.zeros(20, 8)
    custom_ops.gather_mla_context_cache_cpu(dst=unmarked, **call)
    assert torch.equal(unmarked, expected)
    with toy_runtime(None, spec=toy_spec(3), num_blocks=4) as rt:
        schedule = rt.plan.schedule()
        with rt.forward(has_history=False):
            rt.prefetch(schedule.first().layer, schedule.first().slot)
            turn = rt.wait(0, schedule.slot(0))
            chunked = types.SimpleNamespace(workspace=torch.zeros(20, 8), chunks=[None])  # one chunk
            stream = ChunkStream(turn, types.SimpleNamespace(_kvpp_layer=0),
                                 types.SimpleNamespace(prefill=types.SimpleNamespace(chunked_context=chunked)))
            token = STREAMING.set(stream)
            try:
                marked = torch.zeros(20, 8)
                custom_ops.gather_mla_context_cache_cpu(dst=marked, **call)
                with pytest.raises(ContextStreamError, match="arguments KVPP does not read"):
                    custom_ops.gather_mla_context_cache_cpu(dst=marked, not_an_argument=1, **call)
            finally:
                STREAMING.reset(token)
            for layer in schedule.target_layers[1:]:
                rt.prefetch(layer, schedule.slot(layer))
                rt.wait(layer, schedule.slot(layer))
        assert torch.equal(marked, expected) and stream.streamed == 1  # the refused call streamed nothing
        stats = rt.stats()
        assert (stats["per_layer"][0]["context_chunks"], stats["context_bytes"]) == (1, 0)  # a group of one moves none


def test_only_impls_that_read_history_through_vllms_chunks_stream_it():
    """CPU_MLA's, TRITON_MLA's and FlashMLA's impls read prefill history through ``MLACommonBaseImpl``'s
    chunked context, which KVPP streams; an impl with a ``forward_mha`` of its own (as vLLM's dots3_note
    attention has) does not, so its prefill history keeps slots (the control)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    from vllm.v1.attention.backends.mla.flashmla import FlashMLAImpl
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

    from kvpp_fx.integrations.vllm.attention.context_stream import reads_history_through_vllms_chunks

    assert all(reads_history_through_vllms_chunks(cls) for cls in (CPUMLAImpl, TritonMLAImpl, FlashMLAImpl))

    class OwnPrefill(TritonMLAImpl):
        def forward_mha(self, *args, **kwargs):
            raise AssertionError("never called")

    assert not reads_history_through_vllms_chunks(OwnPrefill)
