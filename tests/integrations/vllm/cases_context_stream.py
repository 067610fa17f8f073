"""Prefill history streamed in vLLM's MLA prefill (`context_stream`), against vLLM's real classes on two gloo
ranks, without an engine: vLLM's CPU_MLA impl, hooked as a KVPP worker hooks it (`owner_rows.hook_impl`,
then `context_stream.hook_impl`), its chunked-context metadata from vLLM's own chunk planner, its CPU
prefill backend, and a compact-slot runtime over a cache of the impl's shape.

Like the other `cases_*.py` files, `test_vllm_objects.py::test_against_vllm_objects` runs this file in a pytest
of its own (the name keeps the main run from collecting it); its ranks import vLLM themselves.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.support.launch import kvpp_group, launch

pytestmark = pytest.mark.multirank

HEADS, KV_LORA, ROPE, NOPE, V = 2, 8, 4, 4, 4  # per rank: the impl's heads and MLA widths
SCALE = 0.25
BLOCK, NUM_BLOCKS, SCRATCH = 16, 12, 6
# One prefill row: 40 tokens of history, 4 new. A workspace of 32 rows reads its history in two chunks
# (32 tokens, then 8). Its blocks lie inside the compact slot too, so a gather over a non-owner's slot
# reads in range (and reads that slot's rows, not the owner's).
CONTEXT, QUERY, WORKSPACE = 40, 4, 32
TABLE = [[1, 4, 2]]


class KvBProj(torch.nn.Linear):
    """``kv_b_proj`` as vLLM's linear layers return it: (output, bias)."""

    def forward(self, x):
        return super().forward(x), None


def _owners_cache(layer: int) -> torch.Tensor:
    """What the owner of `layer` holds in its persistent cache (every rank can rebuild it)."""
    gen = torch.Generator().manual_seed(100 + layer)
    return torch.randn(NUM_BLOCKS, BLOCK, KV_LORA + ROPE, generator=gen)


def _impl(engine, layer: int):
    """vLLM's CPU_MLA impl of `layer`, hooked as `attention.hook_attention` hooks a target layer's impl."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

    from kvpp_fx.integrations.vllm.attention import context_stream, owner_rows

    proj = KvBProj(KV_LORA, HEADS * (NOPE + V))
    with torch.no_grad():
        proj.weight.copy_(torch.randn(proj.weight.shape, generator=torch.Generator().manual_seed(7)))
        proj.bias.zero_()
    impl = CPUMLAImpl(HEADS, KV_LORA + ROPE, SCALE, 1, None, None, "auto", None, AttentionType.DECODER, None,
                      q_lora_rank=None, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                      qk_head_dim=NOPE + ROPE, v_head_dim=V, kv_b_proj=proj)
    reader = types.SimpleNamespace(impl=impl, get_attn_backend=lambda: CPUMLABackend, kv_cache_dtype="auto")
    owner_rows.hook_impl(reader, engine, layer)
    assert context_stream.hook_impl(reader), "CPU_MLA's impl reads its history through vLLM's chunks"
    return impl


def _metadata():
    """vLLM's MLA metadata of the one prefill row, its context chunks planned by vLLM."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadata,
        MLACommonPrefillMetadata,
        build_mla_chunked_context_metadata,
    )
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    query_start = torch.tensor([0, QUERY], dtype=torch.int32)
    chunked = build_mla_chunked_context_metadata(
        context_lens_cpu=torch.tensor([CONTEXT], dtype=torch.int32), prefill_query_start_loc_cpu=query_start,
        chunked_prefill_workspace=torch.empty(WORKSPACE, KV_LORA + ROPE), chunked_prefill_workspace_size=WORKSPACE,
        block_size=BLOCK, align_chunk_to_block=True, device=torch.device("cpu"), dcp_world_size=1,
        dcp_local_block_size=1, dcp_virtual_block_size=1)
    backend = CPUSDPAMLAPrefillBackend(HEADS, SCALE, KV_LORA, NOPE, ROPE, V, None)
    prefill = MLACommonPrefillMetadata(torch.tensor(TABLE, dtype=torch.int32), query_start, QUERY,
                                       chunked_context=chunked, prefill_backend=backend)
    return MLACommonMetadata(1, QUERY, CONTEXT + QUERY, QUERY, query_start, torch.arange(QUERY), 0, 0, 1,
                             prefill=prefill)


def _stream_ranks(rank: int, world: int):
    """Each layer's prefill context on every rank: streamed in a broadcast forward (the control), then in
    an owner-mode forward (it packs nothing), then with a chunk gathered by a gather KVPP does not wrap."""
    import vllm._custom_ops as custom_ops

    from kvpp_fx.cache.cost import AttentionShape, StepLoad
    from kvpp_fx.integrations.vllm.attention.context_stream import wrap_gathers
    from kvpp_fx.integrations.vllm.engine.state import Communication, EngineState, Layout
    from tests.support.specs import toy_spec
    from tests.support.toy_runtime import run_layers, toy_runtime

    rt = toy_runtime(kvpp_group(world), spec=toy_spec(2, width=KV_LORA + ROPE, block_size=BLOCK),
                     num_blocks=NUM_BLOCKS, scratch_blocks=SCRATCH,
                     attention=AttentionShape(HEADS * world, NOPE + ROPE, V, 4))
    for layer in rt.plan.owned_layers(rt.rank):
        rt.typed_views(layer)["kv"].copy_(_owners_cache(layer))
    vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float32))
    engine = EngineState(config=types.SimpleNamespace(pcp=1), vllm_config=vllm_config,
                         layout=Layout(scratch_blocks=SCRATCH), comm=Communication(runtime=rt))
    wrap_gathers()  # as a KVPP worker whose decode rows may go to the owner does, before hooking its layers
    impls = {layer: _impl(engine, layer) for layer in rt.plan.target_layers}
    metadata = _metadata()
    q = torch.randn(QUERY, HEADS, NOPE + ROPE, generator=torch.Generator().manual_seed(rank))
    out = {"packed": {}, "chunks": len(metadata.prefill.chunked_context.chunks),
           "owned": list(rt.plan.owned_layers(rank))}

    def context(layer):  # vLLM's layer reads its KVPP view: the owner's cache, a compact slot elsewhere
        return impls[layer]._compute_prefill_context(q, rt.typed_views(layer)["kv"], metadata, None)

    def refused(forward, attend_layer_0):
        """What layer 0's prefill context raises in `forward`, on its way out of the forward, as in a step."""
        try:
            with forward:
                run_layers(rt, lambda layer, view: attend_layer_0() if layer == 0 else None,
                           routed=rt.path.owner)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the assertions name it
            return f"{type(exc).__name__}: {exc}"
        return None

    # the control: every chunk streams, and each rank computes vLLM's own result over the owner's cache
    got, expected = {}, {}
    for layer in rt.plan.target_layers:  # no forward: vLLM's own gathers, over the cache the owner holds
        expected[layer] = impls[layer]._compute_prefill_context(q, _owners_cache(layer), metadata, None)

    def attend(layer, view):
        out["packed"][layer] = rt.path.pack
        got[layer] = context(layer)

    with rt.forward(has_history=False, on_turn=engine.step.take_turn):
        run_layers(rt, attend)
    out["equal"] = {layer: all(torch.equal(a, b) for a, b in zip(got[layer], expected[layer]))
                    for layer in rt.plan.target_layers}
    out["streamed_chunks"] = {layer: s["context_chunks"] for layer, s in rt.stats()["per_layer"].items()}

    # 1. an owner-mode forward packs nothing: its compact slots hold no history
    out["unpacked"] = refused(rt.forward(True, mode="owner", load=StepLoad(QUERY, QUERY * (CONTEXT + QUERY)),
                                           on_turn=engine.step.take_turn),
                              lambda: context(0))
    out["broken"] = rt.broken is not None  # the refusals before anything moved leave the runtime usable

    # 2. the chunks after the first are gathered by vLLM's own gather, as a gather KVPP does not wrap would
    wrapped = custom_ops.gather_mla_context_cache_cpu
    calls = []

    def first_wrapped_then_vllms(**kwargs):
        calls.append(1)
        return (wrapped if len(calls) == 1 else wrapped.__wrapped__)(**kwargs)

    def unwrapped():
        custom_ops.gather_mla_context_cache_cpu = first_wrapped_then_vllms
        try:
            context(0)
        finally:
            custom_ops.gather_mla_context_cache_cpu = wrapped

    out["unwrapped"] = refused(rt.forward(has_history=False, on_turn=engine.step.take_turn), unwrapped)
    return out


@pytest.fixture(scope="module")
def streamed():
    """`_stream_ranks`' outcomes, by rank (one launch for the cases below)."""
    return launch(_stream_ranks, 2, timeout_s=300)


def test_the_control_streams_every_chunk_and_gives_vllms_own_result(streamed):
    """In a broadcast forward of a compact-slot runtime (it packs), vLLM's CPU_MLA prefill context streams
    both of its chunks from each layer's owner, and every rank computes exactly vLLM's own result over the
    owner's cache (on the non-owner, its slot never held those rows)."""
    for rank, out in enumerate(streamed):
        assert out["owned"] == [rank] and out["chunks"] == 2, out
        assert out["packed"] == {0: True, 1: True} and out["equal"] == {0: True, 1: True}, (rank, out)
        assert out["streamed_chunks"] == {0: 2, 1: 2}, (rank, out["streamed_chunks"])


def test_a_forward_that_packs_nothing_refuses_to_read_prefill_history(streamed):
    """In an owner-mode forward of a compact-slot runtime (it packs nothing), a prefill row's history is
    refused on every rank (layer 0's owner and the other rank) by `ContextStreamError`, before any chunk
    is read; the runtime stays usable."""
    for rank, out in enumerate(streamed):
        message = out["unpacked"]
        assert message is not None, f"rank {rank}: an owner-mode forward read prefill history"
        assert message.startswith("ContextStreamError: layer 0: a prefill row reads history in a owner-mode forward "
                                  "that packs nothing; its compact scratch slot does not hold that history"), message
        assert not out["broken"]


def test_a_chunk_gathered_by_a_gather_kvpp_does_not_wrap_is_refused(streamed):
    """Where the chunks after the first are gathered by vLLM's own gather (as a gather vLLM adds and KVPP does
    not wrap would be), every rank raises `ContextStreamError` counting the chunks that streamed: the
    others would have been read from a slot that does not hold them."""
    for rank, out in enumerate(streamed):
        message = out["unwrapped"]
        assert message is not None, f"rank {rank}: a chunk KVPP did not stream went unnoticed"
        assert message.startswith("ContextStreamError: layer 0: 1 of the prefill context's 2 chunks streamed from "
                                  "the owner; the others were read from a scratch slot that does not hold them"), \
            message


def _serving_config(max_model_len: int, cache_dtype: str = "auto"):
    """What `layout.history_reserve` reads of a VllmConfig: DeepSeek-V3's attention, bf16, block 64."""
    hf = types.SimpleNamespace(num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_text_config=hf, dtype=torch.bfloat16, max_model_len=max_model_len),
        scheduler_config=types.SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=8192),
        cache_config=types.SimpleNamespace(block_size=64, cache_dtype=cache_dtype),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1, cp_kv_cache_interleave_size=1),
        speculative_config=None)


def test_a_gpu_budget_keeps_the_history_prefetch_buffer_out_of_the_kv_cache():
    """The prefetch buffer of streamed history is one more of vLLM's context workspaces, allocated after
    vLLM measured memory: on a device KVPP keeps its bytes out of the KV budget. vLLM sizes the workspace
    min(max(8 x max_model_len, 4 x max_num_seqs x block), 64K) rows: 64K rows at a 160K context, 65,536
    (4 x 256 x 64) at 2K; 576 bf16 values a row."""
    from kvpp_fx.integrations.vllm.setup.config import KVPPConfig
    from kvpp_fx.integrations.vllm.cache.layout import budget, history_reserve
    from kvpp_fx.integrations.vllm.engine.state import AttentionChoices, EngineState, KVPPAllocationError

    streams = AttentionChoices(streams_history=True)
    state = EngineState(KVPPConfig(enable_kvpp=True, tp=8), None, attention=streams)
    assert history_reserve(_serving_config(163840), state, "cuda") == 65536 * 576 * 2 == 75_497_472
    assert history_reserve(_serving_config(1024), state, "cuda") == 65536 * 576 * 2
    assert history_reserve(_serving_config(512, "fp8_ds_mla"), state, "cuda") == 65536 * 576 * 2
    assert history_reserve(_serving_config(163840), state, "cpu") == 0  # vLLM CPU's KV space is a fixed size
    for choices in (AttentionChoices(), AttentionChoices(streams_history=True, compact_blocker="a connector")):
        other = EngineState(KVPPConfig(enable_kvpp=True, tp=8), None, attention=choices)
        assert history_reserve(_serving_config(163840), other, "cuda") == 0
    runner = types.SimpleNamespace(vllm_config=_serving_config(163840), device="cuda")
    state = EngineState(KVPPConfig(enable_kvpp=True, tp=8), None,
                        attention=AttentionChoices(streams_history=True, owner_blocker="not here"))
    with pytest.raises(KVPPAllocationError, match="prefetch buffer 75497472 bytes: more than the 70000000 bytes"):
        budget(runner, state, 70_000_000)
