"""Owner rows and owner calls on vLLM's MLA backends: where owner rows are refused, and the owner's calls
on TRITON_MLA, FLASHMLA, FLASH_ATTN_MLA, CUTLASS_MLA and FLASHINFER_MLA (metadata, workspace, heads).

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`: vLLM's import changes process-wide state; the name
keeps the main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import types

import pytest
import torch

from kvpp_fx.integrations.vllm.setup.config import KVPPConfig


def test_owner_rows_are_refused_where_vllm_cannot_run_them():
    from kvpp_fx.integrations.vllm.attention.owner_rows import OwnerRowsUnsupportedError, why_not_owner_capable
    from kvpp_fx.integrations.vllm.engine.state import AttentionChoices, EngineState
    from kvpp_fx.integrations.vllm.attention.model_hooks import set_mode as _set_mode

    assert why_not_owner_capable({"CPU_MLA"}, "mla", 1) is None
    assert why_not_owner_capable({"TRITON_MLA"}, "mla", 1) is None
    assert "AMX_MLA builds its decode metadata" in why_not_owner_capable({"AMX_MLA", "CPU_MLA"}, "mla", 1)
    assert why_not_owner_capable({"CPU_MLA"}, "sfa", 1) == (
        "the model is SFA: attention backend CPU_MLA is not known to run a sparse owner call (owner rows run on [])")
    assert "FLASHMLA_SPARSE is not known to run a sparse owner call" in why_not_owner_capable({"FLASHMLA_SPARSE"},
                                                                                           "sfa", 1)
    assert "the model is MHA" in why_not_owner_capable({"CPU_MLA"}, "mha", 1)
    from kvpp_fx.integrations.vllm.attention.owner_rows import shared_topk_blocker

    assert shared_topk_blocker({0, 1, 2, 3}, {0, 1, 2, 3}) is None
    assert shared_topk_blocker({0, 1, 2, 3}, {0, 2}).startswith(
        "the model is SFA and layers [1, 3] reuse an earlier layer's top-k")
    assert "prefill context parallelism" in why_not_owner_capable({"CPU_MLA"}, "mla", 2)
    state = EngineState(KVPPConfig(enable_kvpp=True, tp=2), None,
                        attention=AttentionChoices(owner_blocker="the model is SFA"))
    with pytest.raises(OwnerRowsUnsupportedError, match="kvpp_mode='owner' cannot run here: the model is SFA. "
                                                        "Set kvpp_mode to 'auto'"):
        _set_mode(state, "owner")
    with pytest.raises(ValueError, match="kvpp_mode must be one of"):
        _set_mode(state, "sideways")
    _set_mode(state, "broadcast")
    assert state.attention.mode == "broadcast"


def _triton_mla_call(q, cache, block_table, seq_lens, splits_for=4):
    """`TritonMLAImpl.forward_mqa` itself (vLLM's code, its Triton kernel interpreted), on a stand-in impl,
    metadata and layer that hold what it reads."""
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

    impl = types.SimpleNamespace(kv_lora_rank=512, scale=0.07, _sm_count=splits_for, dcp_world_size=1)
    decode = types.SimpleNamespace(block_table=block_table, seq_lens=seq_lens)
    metadata = types.SimpleNamespace(decode=decode, max_seq_len=int(seq_lens.max()), causal=True)
    layer = types.SimpleNamespace(_k_scale=torch.ones((), dtype=torch.float32))
    out, _ = TritonMLAImpl.forward_mqa(impl, q, cache, metadata, layer)
    return out


@pytest.mark.parametrize("heads_per_rank,group,splits", [(2, 2, 1), (2, 4, 4), (8, 2, 4)])
def test_triton_mla_owner_calls_give_each_rank_the_bits_of_its_own_call(heads_per_rank, group, splits):
    """`owner_call` runs TRITON_MLA once per rank's heads, each call the shape of that rank's own, so each
    rank gets exactly the bits of its own call (float32, the kernel interpreted). One call over every rank's
    heads is only close: numpy's matmul under Triton's interpreter may round a head's row by its position in
    the tile, depending on the CPU (equal bits on some hosts, 1e-6 apart on others), as a GPU kernel's tiles
    may (docs/design-owner.md, "Bit-identical results"). The control: the heads split back in the wrong order."""
    from kvpp_fx.integrations.vllm.attention.backends import owner_call

    torch.manual_seed(0)
    num_blocks, block, batch = 12, 16, 3
    cache = torch.randn(num_blocks, block, 576)
    block_table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [4, 8, 6, 10]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 64, 17], dtype=torch.int32)
    queries = [torch.randn(batch, heads_per_rank, 576) for _ in range(group)]
    own = [_triton_mla_call(q, cache, block_table, seq_lens, splits) for q in queries]
    calls = []

    def forward_mqa(q, metadata):
        calls.append(q.shape[1])
        return _triton_mla_call(q, cache, block_table, seq_lens, splits)

    parts = owner_call("TRITON_MLA", forward_mqa, torch.cat(queries, dim=1), None, heads_per_rank)
    assert calls == [heads_per_rank] * group
    assert all(torch.equal(part, mine) for part, mine in zip(parts.split(heads_per_rank, dim=1), own))
    folded = _triton_mla_call(torch.cat(queries, dim=1), cache, block_table, seq_lens, splits)
    for part, mine in zip(folded.split(heads_per_rank, dim=1), own):
        torch.testing.assert_close(part, mine, rtol=1.3e-6, atol=1e-5)  # float32's defaults
    assert not torch.allclose(parts.split(heads_per_rank, dim=1)[1], own[0], rtol=1e-2, atol=1e-2)


def test_owner_calls_get_their_own_metadata_where_the_backend_sizes_it_by_heads():
    """FLASH_ATTN_MLA's ahead-of-time scheduler metadata is sized for the rank's heads: owner calls run without
    it (FA3 plans the call itself); vLLM's object stays as it is. FLASH_ATTN_MLA and FLASHMLA import only with
    their CUDA extensions, so their decode metadata stands in here with vLLM's common fields and the one
    field KVPP replaces (`scheduler_metadata`). Other backends read vLLM's metadata unchanged."""
    import dataclasses

    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata

    from kvpp_fx.integrations.vllm.attention.backends import owner_metadata

    @dataclasses.dataclass
    class FlashAttnMLADecodeMetadata(MLACommonDecodeMetadata):  # vLLM's, less the fields KVPP does not touch
        scheduler_metadata: torch.Tensor | None = None

    decode = FlashAttnMLADecodeMetadata(block_table=torch.zeros(2, 4, dtype=torch.int32),
                                        seq_lens=torch.tensor([5, 9]), dcp_tot_seq_lens=None,
                                        scheduler_metadata=torch.ones(8, dtype=torch.int32))
    metadata = types.SimpleNamespace(decode=decode)

    @dataclasses.dataclass
    class Metadata:
        decode: FlashAttnMLADecodeMetadata

    vllms = Metadata(decode)
    owner = owner_metadata("FLASH_ATTN_MLA", vllms, 8, False)
    assert owner.decode.scheduler_metadata is None and owner.decode.block_table is decode.block_table
    assert vllms.decode.scheduler_metadata is not None  # vLLM's object is not changed
    assert owner_metadata("TRITON_MLA", metadata, 8, True) is metadata
    assert owner_metadata("CPU_MLA", metadata, 8, False) is metadata


def test_flashmla_owner_calls_share_one_fresh_scheduling_metadata_per_step():
    """FLASHMLA (bf16) plans its scheduling metadata in the step's first call, for that call's heads, and
    asserts the same heads in every later call. vLLM's decode metadata and FlashMLASchedMeta (its stand-in
    where the CUDA extension is absent; the kernel itself needs a GPU): each step's owner calls get one
    fresh FlashMLASchedMeta, shared by all of that step's owner calls and none of the ranks' own calls; the
    next step gets another; vLLM's object is unchanged."""
    import dataclasses

    from vllm.v1.attention.backends.mla.flashmla import FlashMLADecodeMetadata
    from vllm.v1.attention.ops.flashmla import FlashMLASchedMeta

    from kvpp_fx.integrations.vllm.setup.config import KVPPConfig
    from kvpp_fx.integrations.vllm.engine.state import EngineState

    @dataclasses.dataclass
    class Metadata:  # FlashMLAMetadata, less the common fields KVPP does not touch
        decode: FlashMLADecodeMetadata
        num_decodes: int

    def step_metadata():
        decode = FlashMLADecodeMetadata(block_table=torch.zeros(2, 4, dtype=torch.int32),
                                        seq_lens=torch.tensor([5, 9]), dcp_tot_seq_lens=None,
                                        scheduler_metadata=FlashMLASchedMeta())
        return Metadata(decode, 2)

    state = EngineState(KVPPConfig(enable_kvpp=True, tp=2), vllm_config=None)
    first = step_metadata()
    owner = state.step.owner_metadata("FLASHMLA", first, 8, False)
    assert isinstance(owner.decode.scheduler_metadata, FlashMLASchedMeta)
    assert owner.decode.scheduler_metadata is not first.decode.scheduler_metadata
    assert owner.decode.block_table is first.decode.block_table and owner.num_decodes == 2
    assert state.step.owner_metadata("FLASHMLA", first, 8, False) is owner  # every owner call of the step
    state.step.begin()  # the next step (`step.step_forward`)
    second = step_metadata()
    assert (state.step.owner_metadata("FLASHMLA", second, 8, False).decode.scheduler_metadata
            is not owner.decode.scheduler_metadata)


def flashmla_interface():
    """FlashMLA's own Python interface, from vLLM's CUDA wheel (`make` keeps that one file under the venv),
    over a fake kernel that checks the shapes and dtypes FlashMLA's dense decode documents and returns
    outputs of its documented shapes."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(sys.prefix) / "vllm-cuda-sources" / "vllm" / "third_party" / "flashmla" / "flash_mla_interface.py"
    assert path.is_file(), f"{path} is missing: `make` extracts it from vLLM's CUDA wheel"
    sys.modules.setdefault("vllm._flashmla_C", types.ModuleType("vllm._flashmla_C"))  # the CUDA extension
    spec = importlib.util.spec_from_file_location("flash_mla_interface_of_vllms_cuda_wheel", path)
    interface = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(interface)
    calls = []

    def dense_decode_fwd(q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal,
                         tile_scheduler_metadata, num_splits, out=None):
        b, s_q, h_q, d = q.shape
        assert d == 576 and head_dim_v == 512 and q.dtype == torch.bfloat16 and q.is_contiguous()
        assert k_cache.dim() == 4 and k_cache.shape[2:] == (1, 576) and k_cache.dtype == q.dtype
        assert block_table.dtype == torch.int32 and block_table.shape[0] == b
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (b,)
        calls.append(h_q)
        assert out is None or out.shape == (b, s_q, h_q, head_dim_v)
        out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=q.dtype) if out is None else out.zero_()
        return (out, torch.zeros(b, h_q, s_q), torch.zeros(1, 8, dtype=torch.int32),
                torch.zeros(b + 1, dtype=torch.int32))

    interface.flash_mla_cuda = types.SimpleNamespace(dense_decode_fwd=dense_decode_fwd)
    return interface, calls


def test_flashmla_owner_calls_pass_flashmlas_own_scheduling_and_head_count_checks(monkeypatch):
    """vLLM's FlashMLA impl calling FlashMLA's own interface (from the CUDA wheel), as on a GPU: a step's
    scheduling metadata is planned by its first call, for that call's heads, and asserted in every later
    call. A rank's own call (H heads) and the owner's calls (H x G) in one step pass FlashMLA's checks
    with KVPP's owner metadata; given vLLM's shared metadata instead, FlashMLA's own assert fails."""
    import dataclasses

    from vllm.v1.attention.backends.mla import flashmla as backend
    from vllm.v1.attention.backends.mla.flashmla import FlashMLADecodeMetadata, FlashMLAImpl

    from kvpp_fx.integrations.vllm.setup.config import KVPPConfig
    from kvpp_fx.integrations.vllm.attention.backends import owner_call
    from kvpp_fx.integrations.vllm.engine.state import EngineState

    interface, calls = flashmla_interface()
    for name in ("FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache"):  # CUDA's, in vLLM's module
        monkeypatch.setattr(backend, name, getattr(interface, name))

    @dataclasses.dataclass
    class Metadata:  # FlashMLAMetadata, less the common fields KVPP does not touch
        decode: FlashMLADecodeMetadata
        num_decodes: int

    def step_metadata():  # as FlashMLAMetadataBuilder builds a bf16 step's
        scheduling, _ = backend.get_mla_metadata()
        decode = FlashMLADecodeMetadata(block_table=torch.zeros(2, 4, dtype=torch.int32),
                                        seq_lens=torch.tensor([5, 9], dtype=torch.int32), dcp_tot_seq_lens=None,
                                        scheduler_metadata=scheduling)
        return Metadata(decode, 2)

    impl = object.__new__(FlashMLAImpl)  # its __init__ asserts a Hopper GPU; forward_mqa reads these
    impl.kv_cache_dtype, impl.kv_lora_rank, impl.scale, impl.need_to_return_lse_for_decode = "auto", 512, 0.1, False
    cache = torch.zeros(8, 64, 576, dtype=torch.bfloat16)
    heads, group = 4, 2

    def forward_mqa(q, metadata):
        return impl.forward_mqa(q, cache, metadata, layer=None)[0]

    state = EngineState(KVPPConfig(enable_kvpp=True, tp=group), vllm_config=None)
    for _ in range(2):  # two steps
        state.step.begin()
        metadata = step_metadata()
        own = forward_mqa(torch.zeros(2, heads, 576, dtype=torch.bfloat16), metadata)
        for _layer in range(2):  # the owner calls of two owned layers
            out = owner_call("FLASHMLA", forward_mqa, torch.zeros(2, heads * group, 576, dtype=torch.bfloat16),
                             state.step.owner_metadata("FLASHMLA", metadata, heads * group, False), heads)
        assert own.shape == (2, heads, 512) and out.shape == (2, heads * group, 512)
    assert calls == [heads, heads * group, heads * group] * 2
    # The control: the owner call given the step's own metadata, planned for the rank's heads.
    with pytest.raises(AssertionError, match="sched_meta.config.h_q must be equal to num_heads_q"):
        owner_call("FLASHMLA", forward_mqa, torch.zeros(2, heads * group, 576, dtype=torch.bfloat16), metadata, heads)


def flashmla_fp8_kernel(monkeypatch, backend):
    """vLLM's FlashMLA dense-fp8 entry points in its FlashMLA backend module (`get_mla_metadata_dense_fp8`,
    `flash_mla_with_kvcache_fp8`; their CUDA extension is absent here) over a stand-in kernel: it checks the
    arguments the extension's signature takes (fp8 query and cache, 576/512 widths, int32 tables, float32
    descales), checks that the tile plan it runs was made for the call's heads (the plan's num_q_tokens_per_head_k
    is query length x heads, as vLLM's builder makes it, times the DCP size under DCP), and computes the attention
    in float32 from the descaled values, head by head. Returns the plans requested (their head counts)."""
    interface, _ = flashmla_interface()
    planned = []

    def get_mla_metadata_dense_fp8(cache_seqlens, num_q_tokens_per_head_k, num_heads_k):
        assert cache_seqlens.dtype == torch.int32 and num_heads_k == 1
        planned.append(num_q_tokens_per_head_k)
        tiles = torch.zeros(4, 8, dtype=torch.int32)
        tiles[:, 5] = num_q_tokens_per_head_k  # a field the real plan leaves unused: what it was planned for
        return tiles, torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32)

    def flash_mla_with_kvcache_fp8(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                   num_splits, softmax_scale=None, causal=False, descale_q=None, descale_k=None):
        b, s_q, h_q, d = q.shape
        assert q.dtype == k_cache.dtype == torch.float8_e4m3fn and d == 576 and head_dim_v == 512 and causal
        assert k_cache.dim() == 4 and k_cache.shape[2:] == (1, 576) and block_table.dtype == torch.int32
        assert descale_q.shape == descale_k.shape == (1,) and descale_q.dtype == torch.float32
        assert num_splits.shape == (b + 1,)
        assert int(tile_scheduler_metadata[0, 5]) == s_q * h_q, (
            f"tiles planned for {int(tile_scheduler_metadata[0, 5])} query rows per KV head, the call has {s_q * h_q}")
        out = torch.empty(b, s_q, h_q, head_dim_v, dtype=torch.bfloat16)
        for i in range(b):
            n = int(cache_seqlens[i])
            keys = k_cache[block_table[i].long()].reshape(-1, 576)[:n].float() * descale_k
            for head in range(h_q):
                query = q[i, :, head].float() * descale_q
                weights = torch.softmax(query @ keys.T * softmax_scale, dim=-1)
                out[i, :, head] = (weights @ keys[:, :head_dim_v]).to(out.dtype)
        return out, torch.zeros(b, h_q, s_q)

    monkeypatch.setattr(backend, "FlashMLASchedMeta", interface.FlashMLASchedMeta)
    monkeypatch.setattr(backend, "get_mla_metadata_dense_fp8", get_mla_metadata_dense_fp8)
    monkeypatch.setattr(backend, "flash_mla_with_kvcache_fp8", flash_mla_with_kvcache_fp8)
    return planned


def test_flashmla_fp8_owner_calls_descale_every_ranks_quantized_queries_as_their_own_calls(monkeypatch):
    """An fp8 cache on FLASHMLA: each rank quantizes its queries with the layer's static q scale; the owner runs
    vLLM's FlashMLA impl (its fp8 path) over every rank's fp8 queries with a dense-fp8 tile plan of its own,
    made once per step for the group's heads, and each rank's part equals its own call's output exactly. The
    controls: the owner call given vLLM's plan (made for the rank's heads) is refused by the kernel's plan
    check; an owner whose layer holds another q scale gives other outputs (the allocation refuses that:
    `check_scales`)."""
    import dataclasses

    from vllm.v1.attention.backends.mla import flashmla as backend
    from vllm.v1.attention.backends.mla.flashmla import FlashMLADecodeMetadata, FlashMLAImpl

    from kvpp_fx.integrations.vllm.attention.backends import owner_call
    from kvpp_fx.integrations.vllm.engine.state import EngineState

    planned = flashmla_fp8_kernel(monkeypatch, backend)

    @dataclasses.dataclass
    class Metadata:  # FlashMLAMetadata, less the common fields its fp8 forward_mqa does not read
        decode: FlashMLADecodeMetadata
        num_decodes: int
        num_decode_tokens: int

    heads, group, batch = 4, 2, 2
    torch.manual_seed(0)
    q_scale, k_scale = torch.tensor(0.02), torch.tensor(0.03)
    cache = (torch.randn(6, 64, 576) / k_scale).to(torch.float8_e4m3fn)
    table = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([150, 71], dtype=torch.int32)

    def step_metadata():  # as FlashMLAMetadataBuilder._build_decode builds an fp8 step's, for the rank's heads
        scheduling = backend.FlashMLASchedMeta()
        scheduling.tile_scheduler_metadata, scheduling.num_splits = backend.get_mla_metadata_dense_fp8(
            seq_lens, 1 * heads, 1)
        return Metadata(FlashMLADecodeMetadata(block_table=table, seq_lens=seq_lens, dcp_tot_seq_lens=None,
                                               scheduler_metadata=scheduling), batch, batch)

    impl = object.__new__(FlashMLAImpl)  # its __init__ asserts a Hopper GPU; forward_mqa reads these
    impl.kv_cache_dtype, impl.kv_lora_rank, impl.scale, impl.need_to_return_lse_for_decode = "fp8", 512, 0.04, False
    layer = types.SimpleNamespace(_q_scale=q_scale, _k_scale=k_scale)

    def forward_mqa(q, metadata, on=layer):
        return impl.forward_mqa(q, cache, metadata, on)[0]

    # each rank's absorbed queries, quantized as vLLM's static per-tensor fp8 quantization does
    queries = [(torch.randn(batch, heads, 576) / q_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
               for _ in range(group)]
    state = EngineState(KVPPConfig(enable_kvpp=True, tp=group), vllm_config=None)
    state.step.begin()
    step = step_metadata()
    own = [forward_mqa(q, step) for q in queries]
    for _layer in range(2):  # two owned layers' owner calls in one step
        full = owner_call("FLASHMLA", forward_mqa, torch.cat(queries, dim=1),
                          state.step.owner_metadata("FLASHMLA", step, heads * group, True), heads)
        assert full.shape == (batch, heads * group, 512) and full.dtype == torch.bfloat16
        assert all(torch.equal(part, mine) for part, mine in zip(full.split(heads, dim=1), own))
    assert planned == [heads, heads * group]  # vLLM's plan for the step, then one owner plan for the step
    assert step.decode.scheduler_metadata.tile_scheduler_metadata[0, 5] == heads  # vLLM's object unchanged
    assert len({tuple(t.flatten().tolist()) for t in own}) == group  # the ranks' outputs differ
    with pytest.raises(AssertionError, match="tiles planned for 4 query rows per KV head, the call has 8"):
        owner_call("FLASHMLA", forward_mqa, torch.cat(queries, dim=1), step, heads)
    other_scale = types.SimpleNamespace(_q_scale=q_scale * 2, _k_scale=k_scale)
    owner_metadata = state.step.owner_metadata("FLASHMLA", step, heads * group, True)
    skewed = owner_call("FLASHMLA", lambda q, md: forward_mqa(q, md, other_scale), torch.cat(queries, dim=1),
                        owner_metadata, heads)
    assert not torch.equal(skewed[:, :heads], own[0])


def test_cutlass_and_flashinfer_owner_calls_get_what_their_kernels_size_by_heads():
    """CUTLASS_MLA computes 128 heads through the query's strides: the owner's query keeps its heads and
    gets storage for 128 (vLLM's `reserve_query_head_storage`), and more than 128 are refused by name.
    FLASHINFER_MLA sizes its multi-CTA counter in its first call: the first owner call sizes it again,
    later ones keep it."""
    from kvpp_fx.integrations.vllm.attention.backends import before_owner_call, owner_query

    query = torch.randn(3, 64, 576)
    padded = owner_query("CUTLASS_MLA", query)
    assert padded.shape == query.shape and torch.equal(padded, query)
    assert padded.untyped_storage().nbytes() >= 3 * 128 * 576 * 4
    quantized = query.clamp(-448, 448).to(torch.float8_e4m3fn)  # an fp8 cache's queries: storage of one byte each
    padded = owner_query("CUTLASS_MLA", quantized)
    assert padded.dtype == torch.float8_e4m3fn and torch.equal(padded.view(torch.uint8), quantized.view(torch.uint8))
    assert padded.untyped_storage().nbytes() >= 3 * 128 * 576
    assert owner_query("FLASHMLA", query) is query
    with pytest.raises(ValueError, match="CUTLASS_MLA computes at most 128 query heads; an owner call has 129"):
        owner_query("CUTLASS_MLA", torch.randn(3, 129, 576))
    impl = types.SimpleNamespace(_mla_counter_bytes=4096)
    before_owner_call("FLASHINFER_MLA", impl)
    assert impl._mla_counter_bytes is None
    impl._mla_counter_bytes = 8192  # sized by the owner call
    before_owner_call("FLASHINFER_MLA", impl)
    assert impl._mla_counter_bytes == 8192
    other = types.SimpleNamespace(_mla_counter_bytes=4096)
    before_owner_call("TRITON_MLA", other)
    assert other._mla_counter_bytes == 4096


def test_a_plugins_sparse_backend_is_declared_through_kvpps_seam():
    """`register_owner_backend`: a backend declared as running sparse owner calls serves SFA models (and not dense
    MLA ones); declaring a known name otherwise is refused; a dense backend serves no SFA model."""
    from kvpp_fx.integrations.vllm.attention.backends import (BACKENDS, OwnerSupport, owner_blocker,
                                                              register_owner_backend)

    support = OwnerSupport(True, "a plugin's sparse kernel", 64, fp8_cache="none", sparse=True)
    try:
        register_owner_backend("PLUGIN_SPARSE", support)
        register_owner_backend("PLUGIN_SPARSE", support)  # the same declaration again: nothing changes
        assert owner_blocker("PLUGIN_SPARSE", sparse=True) is None
        assert "not known to run an owner call over the group's heads" in owner_blocker("PLUGIN_SPARSE")
        assert "PLUGIN_SPARSE" in owner_blocker("FLASHMLA", sparse=True)  # the sparse ones it names
        with pytest.raises(ValueError, match="attention backend FLASHMLA is already declared"):
            register_owner_backend("FLASHMLA", support)
    finally:
        BACKENDS.pop("PLUGIN_SPARSE", None)


def test_every_cuda_mla_backend_is_owner_capable_or_refused_by_name():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvpp_fx.integrations.vllm.attention.backends import BACKENDS, owner_blocker, owner_capable_backends
    from kvpp_fx.integrations.vllm.attention.owner_rows import why_not_owner_capable

    mla = {b.name for b in AttentionBackendEnum if b.name.endswith("_MLA") or b.name == "FLASHMLA"}
    dense = {"CPU_MLA", "AMX_MLA", "TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "CUTLASS_MLA"}
    assert dense <= mla and dense <= set(BACKENDS)
    assert {"TRITON_MLA", "FLASHMLA", "CPU_MLA"} <= set(owner_capable_backends())
    assert owner_blocker("TRITON_MLA") is None and owner_blocker("FLASHMLA") is None
    assert "AMX_MLA allocates its decode buffers by its own head count" in owner_blocker("AMX_MLA")
    unknown = owner_blocker("ROCM_AITER_MLA")  # any backend the table does not know is refused by name
    assert "ROCM_AITER_MLA is not known to run an owner call" in unknown and "TRITON_MLA" in unknown
    assert why_not_owner_capable({"TRITON_MLA", "CPU_MLA"}, "mla", 1) is None
    assert "AMX_MLA" in why_not_owner_capable({"TRITON_MLA", "AMX_MLA"}, "mla", 1)


def test_triton_mla_owner_calls_fit_the_workspace_vllm_reserved_for_the_ranks_heads(monkeypatch):
    """vLLM's WorkspaceManager with TRITON_MLA's own reservation (its metadata builder's, for the rank's 2
    heads, 4 requests, 64-token context; 4 compute units here), locked as vLLM locks it once the engine runs:
    the owner's attention over a group of 4 ranks' heads (`backends.owner_call`, vLLM's own forward_mqa and
    kernel, interpreted) runs one call per rank's heads, each fits, and each rank gets exactly its own call's
    output. The control: one call over the group's 8 heads needs a larger workspace, which the locked manager
    refuses. (Reserving that for DeepSeek-V3 at TP 8 with vLLM's default 1024 sequences would take about
    66 GiB per rank.)"""
    import vllm.v1.worker.workspace as workspace
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAMetadataBuilder

    from kvpp_fx.integrations.vllm.attention.backends import owner_call

    units = 4
    # the manager hands freed memory back to the accelerator before it grows; a CPU host has none
    monkeypatch.setattr("torch.accelerator.empty_cache", lambda: None)
    monkeypatch.setattr("vllm.v1.attention.backends.mla.triton_mla.current_platform.num_compute_units",
                        lambda *a: units, raising=False)

    class Builder(types.SimpleNamespace):  # what TRITON_MLA's builder reads; its own reservation method
        _reserve_attn_logits_workspace = TritonMLAMetadataBuilder._reserve_attn_logits_workspace

    heads, group, batch = 2, 4, 3
    builder = Builder(vllm_config=types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=4)),
                      reorder_batch_threshold=1, num_heads=heads, dcp_world_size=1,
                      model_config=types.SimpleNamespace(max_model_len=64),
                      mla_dims=types.SimpleNamespace(kv_lora_rank=512))
    torch.manual_seed(0)
    cache = torch.randn(12, 16, 576)
    block_table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [4, 8, 6, 10]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 64, 17], dtype=torch.int32)
    queries = [torch.randn(batch, heads, 576) for _ in range(group)]

    def forward_mqa(q, metadata):
        return _triton_mla_call(q, cache, block_table, seq_lens, units)

    try:
        workspace.init_workspace_manager(torch.device("cpu"))
        builder._reserve_attn_logits_workspace()
        workspace.lock_workspace()
        own = [forward_mqa(q, None) for q in queries]
        full = owner_call("TRITON_MLA", forward_mqa, torch.cat(queries, dim=1), None, heads)
        assert full.shape == (batch, heads * group, 512)
        assert all(torch.equal(part, mine) for part, mine in zip(full.split(heads, dim=1), own))
        with pytest.raises(AssertionError, match="Workspace is locked"):
            forward_mqa(torch.cat(queries, dim=1), None)
    finally:
        workspace.reset_workspace_manager()
