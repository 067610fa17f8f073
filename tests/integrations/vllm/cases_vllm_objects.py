"""Tests against vLLM's real classes, in-process. vLLM's import changes process-wide state, so
`test_vllm.py::test_against_vllm_objects` runs this file in a pytest of its own (the name keeps the
main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import contextlib
import types

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    get_kv_quant_mode,
)

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.integrations.vllm.setup.config import (
    KVPP_CONNECTOR_MODULE,
    KVPP_VLLM_CONNECTORS,
    MSG_ADAPTIVE,
    MSG_DECODE_NODE,
    MSG_NOT_KVPP_CONNECTOR,
    MSG_PRODUCER_ONLY,
    MSG_SPEC_TOKENS,
    MSG_VLLM_CONNECTOR,
    VLLM_CONNECTORS,
    Deployment,
    KVPPConfig,
)
from kvpp_fx.integrations.vllm.engine.batch import StepBatch, active_blocks, written_blocks
from kvpp_fx.integrations.vllm.engine.runner_v1 import block_rows
from kvpp_fx.integrations.vllm.cache.specs import KVPPSpecError, per_layer_specs, plan_from_specs

ON = KVPPConfig(enable_kvpp=True, tp=2)


def mla(block_size=16, head_size=576, dtype=torch.bfloat16, cache_dtype="auto", **extra):
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=head_size, dtype=dtype,
                            cache_dtype_str=cache_dtype, kv_quant_mode=get_kv_quant_mode(cache_dtype), **extra)


def indexer(block_size=16, head_dim=128 + 4):
    # As DeepseekV32IndexerCache.get_kv_cache_spec builds it: fp8 keys plus a 4-byte scale, one uint8 row.
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=head_dim,
                            dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)


def attn(i):
    return f"model.layers.{i}.self_attn.attn"


def test_bf16_mla_uses_vllms_page_size():
    vplan = plan_from_specs({attn(i): mla() for i in range(4)}, 2, 4)
    comp = vplan.plan.spec.layer(0).components[0]
    assert (comp.name, comp.dtype, comp.per_token) == ("kv", "bfloat16", (576,))
    assert vplan.plan.bundle_bytes_per_block(0) == mla().page_size_bytes == 16 * 576 * 2
    assert vplan.plan.target_layers == (0, 1, 2, 3) and vplan.plan.local_draft_layers == ()


def test_fp8_ds_mla_is_656_bytes_per_token_not_head_size():
    spec = mla(block_size=64, dtype=torch.uint8, cache_dtype="fp8_ds_mla", state_content_bytes=656)
    vplan = plan_from_specs({attn(0): spec, attn(1): spec}, 2, 2)
    comp = vplan.plan.spec.layer(0).components[0]
    assert (comp.dtype, comp.per_token) == ("uint8", (656,))
    assert vplan.plan.bundle_bytes_per_block(0) == spec.page_size_bytes == 64 * 656 != 64 * 576


@pytest.mark.parametrize("cache_dtype,torch_dtype,name", [("fp8", torch.uint8, "uint8"),
                                                         ("fp8_e5m2", torch.uint8, "uint8"),
                                                         ("fp8_inc", torch.float8_e4m3fn, "float8_e4m3fn")])
def test_fp8_caches_allocate_with_vllms_dtype(cache_dtype, torch_dtype, name):
    spec = mla(dtype=torch_dtype, cache_dtype=cache_dtype)
    vplan = plan_from_specs({attn(0): spec, attn(1): spec}, 2, 2)
    assert vplan.plan.spec.layer(0).components[0].dtype == name
    view = allocate_cache(vplan.plan, 0, 8).typed_views(1)["kv"]
    assert view.dtype == torch_dtype and tuple(view.shape) == (8, 16, 576)


def test_sfa_indexer_is_a_component_of_the_same_bundle():
    specs = {}
    for i in range(3):
        specs[attn(i)] = mla()
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = indexer()
    vplan = plan_from_specs(specs, 2, 3)
    assert vplan.plan.target_layers == (0, 1, 2)
    assert [c.name for c in vplan.plan.spec.layer(1).components] == ["kv", "indexer"]
    assert vplan.component["model.layers.1.self_attn.indexer.k_cache"] == "indexer"
    assert vplan.plan.bundle_bytes_per_block(1) == mla().page_size_bytes + indexer().page_size_bytes
    assert vplan.logical_bytes_per_block == sum(s.page_size_bytes for s in specs.values())
    views = allocate_cache(vplan.plan, 0, 4).typed_views(2)
    assert tuple(views["indexer"].shape) == (4, 16, 132) and views["indexer"].dtype == torch.uint8
    # Same bundle, one owner: the indexer moves with its layer.
    assert vplan.plan.owners[2] == 1


def test_mtp_layers_are_local_drafts():
    specs = {attn(i): mla() for i in range(5)}  # 4 target layers + MTP layer 4
    plan = plan_from_specs(specs, 2, 4).plan
    assert plan.target_layers == (0, 1, 2, 3) and plan.local_draft_layers == (4,)
    assert 4 not in plan.owners
    for rank in (0, 1):
        assert plan.is_local(4, rank)
        assert 4 in allocate_cache(plan, rank, 4).persistent_layers
    # Without the target layer count every layer would be a broadcast target (the old behaviour).
    assert plan_from_specs(specs, 2).plan.target_layers == (0, 1, 2, 3, 4)


def test_uniform_type_group_is_unpacked():
    specs = {attn(0): mla(), "model.layers.0.self_attn.indexer.k_cache": indexer()}
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=UniformTypeKVCacheSpecs(block_size=16,
                                                                                        kv_cache_specs=specs))])
    assert per_layer_specs(config) == specs


@pytest.mark.parametrize("specs,match", [
    ({attn(0): FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)},
     "places only MLA caches"),
    ({attn(0): mla(dtype=torch.float64)}, "dtype float64"),
    ({attn(0): mla(alignment=4096)}, "padded pages"),
    ({attn(0): mla(), "model.layers.0.self_attn.mla_attn": mla()}, "both the 'kv' cache of layer 0"),
    ({"model.layers.0.self_attn.indexer.k_cache": indexer()}, "indexer cache but no MLA cache"),
    ({attn(0): mla(block_size=16), attn(1): mla(block_size=32)}, "one block size"),
    ({"lm_head.attn": mla()}, "cannot read a layer index"),
], ids=["mha", "float64", "padded", "duplicate", "indexer-only", "block-sizes", "no-index"])
def test_specs_kvpp_cannot_place_are_named(specs, match):
    with pytest.raises(KVPPSpecError, match=match):
        plan_from_specs(specs, 2)


def v1_batch(table, computed, query=None):
    """The step batch V1's adapter builds from its block table, for the first len(computed) requests."""
    n = len(computed)
    return StepBatch.of(computed, query if query is not None else [1] * n, [0] * n, block_rows(table, n))


def test_active_blocks_from_vllms_block_table():
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    table = MultiGroupBlockTable(max_num_reqs=4, max_num_batched_tokens=64, pin_memory=False,
                                 device=torch.device("cpu"), block_sizes=[16], max_num_blocks=[8])
    table.append_row(([7, 3, 9],), 0)  # 40 tokens computed: blocks 7, 3, 9 (partly)
    table.append_row(([5, 2],), 1)     # first prefill: nothing computed yet
    table.append_row(([3, 11],), 2)    # a prefix-cache hit of 16 tokens: block 3, shared with row 0
    table.append_row(([30],), 3)       # not scheduled this step (beyond num_reqs)
    computed = [40, 0, 16, 16]
    assert active_blocks(v1_batch(table, computed[:3])) == [3, 7, 9]
    assert active_blocks(v1_batch(table, [32])) == [3, 7]  # exactly two full blocks
    assert active_blocks(v1_batch(table, computed)) == [3, 7, 9, 30]


def test_written_blocks_from_vllms_block_table():
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    table = MultiGroupBlockTable(max_num_reqs=4, max_num_batched_tokens=64, pin_memory=False,
                                 device=torch.device("cpu"), block_sizes=[16], max_num_blocks=[8])
    table.append_row(([7, 3, 9],), 0)  # a decode after 32 tokens: its token opens block 9
    table.append_row(([5, 2],), 1)     # a first prefill of 20 tokens: blocks 5 and 2
    table.append_row(([3, 11],), 2)    # a decode after 17 tokens: writes into block 11, which holds history
    table.append_row(([30],), 3)       # not scheduled this step (beyond num_reqs)
    assert written_blocks(v1_batch(table, [32, 0, 17], [1, 20, 1])) == [2, 5, 9]
    assert written_blocks(v1_batch(table, [32, 0, 17, 0], [1, 20, 1, 1])) == [2, 5, 9, 30]


def test_step_requests_group_the_decode_rows_and_name_each_prefill():
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    from kvpp_fx.integrations.vllm.attention.owner_rows import step_requests

    table = MultiGroupBlockTable(max_num_reqs=4, max_num_batched_tokens=64, pin_memory=False,
                                 device=torch.device("cpu"), block_sizes=[16], max_num_blocks=[8])
    table.append_row(([7, 3, 9],), 0)  # decode after 40 computed tokens
    table.append_row(([3, 4],), 1)     # decode after 17, sharing block 3
    table.append_row(([5, 2],), 2)     # a first prefill of 30 tokens
    table.append_row(([6, 8],), 3)     # a prefill of 10 tokens after 16 computed (a resumed session)
    computed = [40, 17, 0, 16]
    query = [1, 1, 30, 10]
    batch = v1_batch(table, computed, query)
    # The layer's metadata as vLLM's MLA builder sets it for this batch: the first two requests decode.
    metadata = {"model.layers.0.self_attn.attn": types.SimpleNamespace(num_decodes=2)}
    requests, decodes = step_requests(metadata, "model.layers.0.self_attn.attn", batch, True)
    assert decodes == 2
    assert [(r.query_tokens, r.attention_pairs, r.blocks, r.owner_capable) for r in requests] == [
        (2, 41 + 18, (3, 4, 7, 9), True), (30, 900, (), False), (10, 260, (6,), False)]
    # The decodes write into blocks that hold history (9 after 40 tokens, 4 after 17). The first prefill
    # fills 5 and 2, but attends over its own new keys: they take no slot position. The later prefill
    # reads its history from the slot, and its block 8 has a position.
    assert [r.written for r in requests] == [(), (), (8,)]
    # With compact slots the prefill rows' history streams from the owners: the later prefill lists
    # neither its history block nor the one it fills; the decode rows are as before.
    streamed, _ = step_requests(metadata, "model.layers.0.self_attn.attn", batch, True, streams_history=True)
    assert [(r.blocks, r.written) for r in streamed] == [((3, 4, 7, 9), ()), ((), ()), ((), ())]
    first_three = v1_batch(table, computed[:3], query[:3])
    assert step_requests({}, "model.layers.0.self_attn.attn", first_three, True) is None
    assert step_requests(metadata, "model.layers.0.self_attn.attn", first_three, False)[0][0].owner_capable is False
    # micro-batches (DBO) come as a list of metadata dicts, whose rows are not the batch's: no requests,
    # so the step broadcasts every row's blocks
    assert step_requests([metadata, metadata], "model.layers.0.self_attn.attn", first_three, True) is None


def _v2_block_tables(block_sizes=(16, 32), widths=(8, 4)):
    import vllm.v1.worker.cpu_worker  # noqa: F401  (vLLM CPU's stand-ins for CUDA streams and pinned memory)
    from vllm.v1.worker.gpu.block_table import BlockTables

    return BlockTables(block_sizes=list(block_sizes), max_num_reqs=4, max_num_batched_tokens=64,
                       max_num_blocks_per_group=list(widths), device=torch.device("cpu"))


def test_v2_host_block_tables_equal_the_gathered_device_tables():
    """V2 keeps block ids in device tables only (staged writes, gathered by a Triton kernel, here
    interpreted). KVPP's mirror records what ``append_block_ids`` stages: its rows in batch order equal
    the rows V2's ``gather_block_tables`` gives attention, in two cache groups, through new requests,
    appends and a row rewritten. The control: a write that bypasses the mirror shows."""
    from kvpp_fx.integrations.vllm.engine.runner_v2 import HostBlockTables

    tables = _v2_block_tables()
    mirror = HostBlockTables.attach(tables)
    tables.append_block_ids(0, ([7, 3, 9], [1]), overwrite=True)
    tables.append_block_ids(2, ([5, 2, 10], [4, 6]), overwrite=True)
    tables.apply_staged_writes()
    tables.append_block_ids(0, ([11], []), overwrite=False)  # a decode opens a block
    tables.append_block_ids(2, ([6, 8], [2]), overwrite=True)  # a resumed request's row, rewritten shorter
    tables.append_block_ids(1, ([12], [13]), overwrite=True)
    tables.apply_staged_writes()

    def matches(idx):
        """Each row's entries up to its block count (the gather leaves the rest of its buffer as it was)."""
        gathered = tables.gather_block_tables(torch.as_tensor(idx), num_reqs_padded=len(idx))
        mirrored = mirror.step_rows(np.asarray(idx))
        counts = tables.num_blocks.np[:, idx]
        return all(g[i, :n].tolist() == m.rows[i, :n].tolist()
                   for g, m, group_counts in zip(gathered, mirrored, counts) for i, n in enumerate(group_counts))

    assert matches([2, 0, 1]) and matches([1]) and matches([0, 2])
    rows = mirror.step_rows(np.array([0, 2]))
    assert [r.block_size for r in rows] == [16, 32]
    assert rows[0].rows.tolist() == [[7, 3, 9, 11, 0, 0, 0, 0], [6, 8, 0, 0, 0, 0, 0, 0]]
    assert rows[1].rows.tolist() == [[1, 0, 0, 0], [2, 0, 0, 0]]
    type(tables).append_block_ids(tables, 1, ([14], [15]), overwrite=False)  # vLLM's own, unmirrored
    tables.apply_staged_writes()
    assert not matches([2, 0, 1]) and matches([2, 0])


def test_v2_step_batch_from_a_real_input_batch():
    """The step V2's adapter hands the runtime: counts and query lengths of V2's ``InputBatch`` in batch
    order, and the mirrored rows of the requests its ``idx_mapping_np`` names."""
    import dataclasses

    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from kvpp_fx.integrations.vllm.engine.batch import history_blocks
    from kvpp_fx.integrations.vllm.engine.runner_v2 import HostBlockTables, step_batch

    tables = _v2_block_tables(block_sizes=(16,), widths=(8,))
    runner = types.SimpleNamespace(pcp_manager=None, _kvpp_tables=HostBlockTables.attach(tables))
    tables.append_block_ids(3, ([7, 3, 9],), overwrite=True)  # batch row 0: a decode after 40 tokens
    tables.append_block_ids(1, ([5, 2],), overwrite=True)  # batch row 1: a first prefill of 30 tokens
    tables.apply_staged_writes()
    dummy = InputBatch.make_dummy(2, 31, InputBuffers(4, 64, torch.device("cpu")))
    batch = dataclasses.replace(dummy, idx_mapping_np=np.array([3, 1]), num_computed_tokens_np=np.array([40, 0]),
                                query_start_loc_np=np.array([0, 1, 31]), prefill_len_np=np.array([40, 30]))
    step = step_batch(runner, batch)
    assert step.num_computed.tolist() == [40, 0] and step.query_lens.tolist() == [1, 30] and step.has_history
    assert [history_blocks(step, i, i + 1) for i in range(2)] == [[3, 7, 9], []]
    assert [written_blocks(step, i, i + 1) for i in range(2)] == [[], [2, 5]]
    assert active_blocks(step) == [3, 7, 9] and written_blocks(step) == [2, 5]


def test_owner_rows_are_refused_where_vllm_cannot_run_them():
    from kvpp_fx.integrations.vllm.attention.owner_rows import OwnerRowsUnsupportedError, why_not_owner_capable
    from kvpp_fx.integrations.vllm.engine.state import AttentionChoices, EngineState
    from kvpp_fx.integrations.vllm.attention.model_hooks import set_mode as _set_mode

    assert why_not_owner_capable({"CPU_MLA"}, "mla", 1) is None
    assert why_not_owner_capable({"TRITON_MLA"}, "mla", 1) is None
    assert "AMX_MLA builds its decode metadata" in why_not_owner_capable({"AMX_MLA", "CPU_MLA"}, "mla", 1)
    assert "quantizes the queries" in why_not_owner_capable({"FLASHMLA"}, "mla", 1, quantized_queries=True)
    assert "SFA" in why_not_owner_capable({"CPU_MLA"}, "sfa", 1)
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


# --- validation with vLLM's config objects ---------------------------------------------------------------


def test_connector_names_are_vllms():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert set(VLLM_CONNECTORS) == set(KVConnectorFactory._registry)
    assert "MooncakeConnectorV2" not in KVConnectorFactory._registry  # vllm-ascend's, KVPP-aware


@pytest.mark.parametrize("name,role,message", [
    ("OffloadingConnector", "kv_both", MSG_VLLM_CONNECTOR.format(name="OffloadingConnector")),
    ("MooncakeStoreConnector", "kv_producer", MSG_VLLM_CONNECTOR.format(name="MooncakeStoreConnector")),
    ("MooncakeConnector", "kv_both", MSG_PRODUCER_ONLY.format(name="MooncakeConnector")),
    ("MooncakeConnectorV2", "kv_consumer", MSG_DECODE_NODE),
])
def test_connector_rule_reads_kv_transfer_config(name, role, message):
    from vllm.config import KVTransferConfig

    config = types.SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector=name, kv_role=role))
    with pytest.raises(ValueError) as err:
        ON.validate(Deployment.from_vllm_config(config))
    assert str(err.value) == message


@pytest.mark.parametrize("prefill_tp,decode_tp,missed", [
    (2, 1, [[]]), (2, 2, [[1], [0]]), (4, 2, [[2, 3], [0, 1]]), (2, 4, [[1], [1], [0], [0]]),
])
def test_mooncake_decode_ranks_that_would_miss_a_kvpp_prefill_ranks_layers(prefill_tp, decode_tp, missed):
    from kvpp_fx.integrations.vllm.kv_connectors.mooncake import ranks_not_asked

    # vLLM's MLA pairing: a decode rank asks every prefill rank only where the decode instance has TP 1.
    assert [ranks_not_asked(prefill_tp, rank, decode_tp) for rank in range(decode_tp)] == missed


def _mooncake_worker(tp_rank, tp_size, registered, owned):
    from kvpp_fx.integrations.vllm.kv_connectors.mooncake import KVPPMooncakeWorker

    worker = object.__new__(KVPPMooncakeWorker)  # no transfer engine: only the checks before vLLM's planning
    worker.tp_rank, worker.tp_size, worker.registered_layer_names = tp_rank, tp_size, registered
    worker._owned = frozenset(owned)
    return worker


def test_a_kvpp_mooncake_rank_refuses_a_decode_rank_that_asks_only_some_prefill_ranks():
    worker = _mooncake_worker(0, 2, ["layer.0"], ["layer.0"])
    meta = types.SimpleNamespace(remote_tp_rank=0, remote_tp_size=2, asks_every_rank=False)
    local, remote, error = worker._prepare_transfer_regions(meta)
    assert (local, remote) == ([], [])
    assert error.startswith("KVPPConnectorError: decode rank 0 (TP 2) asks only some ranks") and "ranks [1]" in error
    assert "kv_connector_module_path='kvpp_fx.integrations.vllm.connectors' on the decode instance" in error


def test_a_kvpp_mooncake_rank_refuses_to_send_a_layer_it_does_not_own():
    worker = _mooncake_worker(0, 2, ["layer.0", "layer.3"], ["layer.0"])
    meta = types.SimpleNamespace(remote_tp_rank=0, remote_tp_size=1, asks_every_rank=False)
    local, remote, error = worker._prepare_transfer_regions(meta)
    assert (local, remote) == ([], [])
    assert error == ("KVPPConnectorError: prefill rank 0 was about to send layers ['layer.3'], which it does not "
                     "own: its binding of them is a scratch slot.")


def _speculative(**fields):
    # SpeculativeConfig's validation loads the draft model; the rule only reads these attributes.
    from vllm.config import SpeculativeConfig

    spec = object.__new__(SpeculativeConfig)
    defaults = dict(method="mtp", num_speculative_tokens=1, num_speculative_tokens_per_batch_size=None,
                    enable_adaptive_verification=False)
    for key, value in {**defaults, **fields}.items():
        object.__setattr__(spec, key, value)
    return types.SimpleNamespace(speculative_config=spec)


def test_speculative_rules_read_vllms_attributes():
    ON.validate(Deployment.from_vllm_config(_speculative()))
    dynamic = _speculative(num_speculative_tokens_per_batch_size=[(1, 8, 2), (9, 64, 1)])
    assert dynamic.speculative_config.uses_dynamic_speculative_decoding()
    with pytest.raises(ValueError, match=MSG_SPEC_TOKENS):
        ON.validate(Deployment.from_vllm_config(dynamic))
    adaptive = _speculative(method="dspark", enable_adaptive_verification=True)
    with pytest.raises(ValueError, match=MSG_ADAPTIVE):
        ON.validate(Deployment.from_vllm_config(adaptive))
    ON.validate(Deployment.from_vllm_config(_speculative(method="dspark")))


# --- hooks -----------------------------------------------------------------------------------------------


class MockAscendPlatform:
    """Stands in for vllm-ascend's NPU platform (NPU hardware is not available here)."""

    device_name = "npu"


def test_ascend_is_refused_with_a_pointer_to_vllm_ascend():
    from kvpp_fx.integrations.vllm.setup.validation import MSG_ASCEND, check_execution

    with pytest.raises(ValueError) as err:
        check_execution(None, platform=MockAscendPlatform())
    assert str(err.value) == MSG_ASCEND and "vllm-ascend" in MSG_ASCEND


def test_vllm_version_range():
    import vllm

    from kvpp_fx.integrations.vllm.setup.validation import MSG_VERSION, SUPPORTED_VLLM, check_version

    check_version(vllm.__version__)
    check_version("0.32.3+cpu")
    for other in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(ValueError) as err:
            check_version(other)
        assert str(err.value) == MSG_VERSION.format(supported=SUPPORTED_VLLM, found=other)


def test_hooks_reach_vllms_worker_and_runner_classes():
    """Both of vLLM's model runners, V1 and V2 (vLLM's default wherever Triton runs), on CPU and CUDA."""
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.gpu import model_runner as v2_runner_module
    from vllm.v1.worker.gpu_worker import Worker

    from kvpp_fx.integrations.vllm.engine import worker

    originals = {"v1": gpu_model_runner.allocate_kv_cache, "v2": attn_utils.allocate_kv_cache,
                 "bracket": v2_runner_module.set_forward_context}

    def kvpp_methods(cls):  # what KVPP's classes define, the adapter's and the base the adapters share
        return {name for kvpp in cls.__mro__ if kvpp.__module__.startswith("kvpp_fx.") for name in vars(kvpp)}

    for base in (CPUWorker, Worker):
        assert issubclass(worker.kvpp_worker_class(base), base)
    for base in (CPUModelRunner, gpu_model_runner.GPUModelRunner):
        hooked, kind = worker.kvpp_runner_class(base)
        assert issubclass(hooked, base) and kind == "V1"
        assert {"_model_forward", "initialize_kv_cache_tensors", "load_model"} <= kvpp_methods(hooked)
    for base in (CPUModelRunnerV2, v2_runner_module.GPUModelRunner):
        hooked, kind = worker.kvpp_runner_class(base)
        assert issubclass(hooked, base) and kind == "V2"
        assert {"execute_model", "prepare_attn", "initialize_kv_cache", "load_model", "update_requests"} <= \
            kvpp_methods(hooked)
    # vLLM's own allocator and forward context still run whenever no KVPP runner is allocating or stepping.
    assert gpu_model_runner.allocate_kv_cache is not originals["v1"]
    assert gpu_model_runner.allocate_kv_cache.__wrapped__ is originals["v1"]
    assert attn_utils.allocate_kv_cache.__wrapped__ is originals["v2"]
    assert v2_runner_module.set_forward_context.__wrapped__ is originals["bracket"]
    qualname = worker.hooked_worker_qualname("vllm.v1.worker.gpu_worker.Worker")
    assert worker.__getattr__(qualname.rsplit(".", 1)[1]) is worker.kvpp_worker_class(Worker)


def test_a_hook_that_cannot_be_applied_names_vllm_version_and_hook():
    import vllm

    from kvpp_fx.integrations.vllm.engine import worker

    class NoBudget:
        def init_device(self): ...
        def load_model(self): ...

    with pytest.raises(worker.KVPPHookError) as err:
        worker.kvpp_worker_class(NoBudget)
    assert f"vLLM {vllm.__version__}" in str(err.value) and "NoBudget.determine_available_memory" in str(err.value)
    with pytest.raises(worker.KVPPHookError, match="V1 and V2 GPUModelRunner"):
        worker.kvpp_runner_class(NoBudget)


def _engine_config(max_num_seqs=1024, budget=16384, speculative_tokens=None):
    """What `layout.exchange_reserve` reads of a VllmConfig: DeepSeek-V3's attention, bf16."""
    hf = types.SimpleNamespace(num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64)
    speculative = None if speculative_tokens is None else types.SimpleNamespace(
        num_speculative_tokens=speculative_tokens)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_text_config=hf, dtype=torch.bfloat16),
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        speculative_config=speculative)


def test_a_gpu_budget_keeps_the_owner_exchanges_peak_for_the_most_decode_rows_a_step_has():
    """vLLM's profile run does not exchange owner rows, so the memory it measures as left for the KV cache
    never held them: on a device KVPP keeps the owner call's peak for max_num_seqs requests (each with its
    speculative tokens, within the token budget) out of the KV budget."""
    from kvpp_fx.cache.cost import AttentionShape
    from kvpp_fx.integrations.vllm.cache.layout import budget, exchange_reserve
    from kvpp_fx.integrations.vllm.engine.state import AttentionChoices, EngineState, KVPPAllocationError

    shape = AttentionShape(128, 576, 512, 2)
    state = EngineState(KVPPConfig(enable_kvpp=True, tp=8), None)
    assert exchange_reserve(_engine_config(), state, "cuda") == shape.owner_exchange_peak_bytes(1024, 8)
    assert exchange_reserve(_engine_config(speculative_tokens=1), state, "cuda") == \
        shape.owner_exchange_peak_bytes(2048, 8)
    assert exchange_reserve(_engine_config(budget=1500, speculative_tokens=1), state, "cuda") == \
        shape.owner_exchange_peak_bytes(1500, 8)
    assert exchange_reserve(_engine_config(), state, "cpu") == 0  # vLLM CPU's KV space is a fixed size
    blocked = EngineState(KVPPConfig(enable_kvpp=True, tp=8), None, attention=AttentionChoices(owner_blocker="AMX_MLA"))
    assert exchange_reserve(_engine_config(), blocked, "cuda") == 0
    runner = types.SimpleNamespace(vllm_config=_engine_config(), device=torch.device("cpu"))
    runner.device = "cuda"
    with pytest.raises(KVPPAllocationError, match="owner-mode exchanges need up to 606076946 bytes"):
        budget(runner, state, 600_000_000)


def test_kvpp_workers_make_their_groups_before_vllm_measures_memory(monkeypatch):
    """NCCL allocates a communicator's buffers at its first collectives: KVPP's groups exist and have run
    them before vLLM's worker measures the memory left for the KV cache, so the measurement holds them."""
    from kvpp_fx.integrations.vllm.cache import allocation, layout

    from kvpp_fx.integrations.vllm.engine import worker
    order = []
    state = types.SimpleNamespace(active=contextlib.nullcontext)

    class Worker:
        def init_device(self): ...
        def load_model(self): ...
        def compile_or_warm_up_model(self): ...

        def determine_available_memory(self):
            order.append("vLLM measures")
            return 1 << 30

    monkeypatch.setattr(allocation, "connect", lambda engine, device: order.append(("connect", engine, device)))
    monkeypatch.setattr(layout, "budget", lambda runner, engine, available: available)
    hooked = worker.kvpp_worker_class(Worker)()
    hooked.model_runner = types.SimpleNamespace(_kvpp=state, device="cuda:3")
    assert hooked.determine_available_memory() == 1 << 30
    assert order == [("connect", state, "cuda:3"), "vLLM measures"]


@pytest.mark.parametrize("block_size,kernel", [(128, 64), (64, 64)])
def test_a_block_size_the_backend_splits_into_kernel_blocks_is_refused_before_allocation(block_size, kernel, monkeypatch):
    """FlashMLA reads 64-token kernel blocks; vLLM splits larger cache blocks into them, and its metadata
    tables then hold kernel block ids, which KVPP's positions and remapped tables do not count."""
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    from kvpp_fx.integrations.vllm.cache.allocation import KernelBlockSizeError, allocating, install_allocator

    specs = {attn(i): mla(block_size=block_size) for i in range(2)}
    group = KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=mla(block_size=block_size))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    sizes = prepare_kernel_block_sizes(config, [[AttentionGroup(FlashMLABackend, list(specs), group.kv_cache_spec, 0)]])
    assert sizes == [kernel]  # vLLM's choice of kernel block size
    install_allocator(attn_utils.__name__)  # V2's call site; V1's passes the same arguments
    allocated = []  # KVPP's allocation, after the check
    monkeypatch.setattr("kvpp_fx.integrations.vllm.cache.allocation.allocate",
                        lambda runner, state, cfg, device: allocated.append(cfg))
    with allocating(None, None):
        if kernel != block_size:
            with pytest.raises(KernelBlockSizeError, match=f"Set block_size={kernel} "):
                attn_utils.allocate_kv_cache(config, torch.device("cpu"), "NHD", sizes)
        else:
            attn_utils.allocate_kv_cache(config, torch.device("cpu"), "NHD", sizes)
    assert allocated == ([] if kernel != block_size else [config])


def test_post_allocation_self_check_catches_unbound_layers_and_block_mismatch():
    from kvpp_fx.integrations.vllm.cache.allocation import self_check
    from kvpp_fx.integrations.vllm.engine.state import EngineState, KVPPAllocationError, Layout

    specs = {attn(i): mla() for i in range(3)}
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=mla())])
    state = EngineState(ON, None, layout=Layout(vplan=plan_from_specs(specs, 2, 3), budget_blocks=8))
    storage = allocate_cache(state.plan, 0, 8)
    state.comm.runtime = types.SimpleNamespace(storage=storage)  # the check reads only the storage
    layers = {name: types.SimpleNamespace(kv_cache=storage.typed_views(i)["kv"]) for i, name in enumerate(specs)}
    runner = types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context=layers),
                                   get_kv_cache_spec=lambda: specs)
    self_check(runner, state, config)
    layers[attn(1)].kv_cache = storage.typed_views(1)["kv"].clone()  # vLLM's own tensor, not KVPP's view
    with pytest.raises(KVPPAllocationError, match="'model.layers.1.self_attn.attn' is not bound"):
        self_check(runner, state, config)
    layers[attn(1)].kv_cache = storage.typed_views(1)["kv"]
    # vLLM gives every worker the smallest count any worker's budget holds (pipeline stages differ).
    state.layout.budget_blocks = 9
    self_check(runner, state, config)
    state.layout.budget_blocks = 7
    with pytest.raises(KVPPAllocationError, match="vLLM planned 8 blocks, the KVPP budget holds 7"):
        self_check(runner, state, config)


def test_dbo_and_dspark_are_refused_by_name():
    """Micro-batched steps run every layer once per micro-batch on threads of their own; DSpark drafts keep
    cache layers kvpp-fx has not placed. Both are refused at construction, whichever runner (on config
    objects: vLLM CPU turns DBO off itself, and cannot build a DSpark config without its checkpoint)."""
    from kvpp_fx.integrations.vllm.setup.validation import MSG_DBO, MSG_DSPARK, check_execution

    cpu = types.SimpleNamespace(device_name="cpu")
    plain = types.SimpleNamespace(parallel_config=types.SimpleNamespace(use_ubatching=False), speculative_config=None)
    check_execution(plain, platform=cpu)  # the control: accepted
    check_execution(types.SimpleNamespace(parallel_config=plain.parallel_config,
                                          speculative_config=types.SimpleNamespace(method="mtp")), platform=cpu)
    for config, message in ((types.SimpleNamespace(parallel_config=types.SimpleNamespace(use_ubatching=True),
                                                   speculative_config=None), MSG_DBO),
                            (types.SimpleNamespace(parallel_config=plain.parallel_config,
                                                   speculative_config=types.SimpleNamespace(method="dspark")), MSG_DSPARK)):
        with pytest.raises(ValueError) as err:
            check_execution(config, platform=cpu)
        assert str(err.value) == message


# --- compilation modes ---------------------------------------------------------------------------------


def _compiled_config(**compilation):
    from vllm.config import CompilationConfig

    return types.SimpleNamespace(compilation_config=CompilationConfig(**compilation),
                                 additional_config={"enable_kvpp": True})


def test_mode_3_lowers_an_unchosen_full_and_piecewise_and_adds_the_kvpp_splitting_ops(caplog):
    from vllm.config import CUDAGraphMode

    from kvpp_fx.integrations.vllm.setup.compile_modes import (
        KVPP_SPLITTING_OPS,
        MSG_LOWERED,
        Requested,
        compile_digest,
        configure_compilation,
    )

    config = _compiled_config(mode=3, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    config.compilation_config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter",
                                                        data_parallel_size=1)  # as vLLM resolves mode 3
    defaults = list(config.compilation_config.splitting_ops)
    with caplog.at_level("WARNING"):
        configure_compilation(config, Requested(cudagraph_mode=None))
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert MSG_LOWERED in caplog.text
    assert config.compilation_config.splitting_ops == defaults + list(KVPP_SPLITTING_OPS)
    assert config.additional_config["kvpp_fx"] == {"digest": compile_digest()}
    configure_compilation(config, Requested(cudagraph_mode="PIECEWISE"))  # a config resolved again
    assert config.compilation_config.splitting_ops == defaults + list(KVPP_SPLITTING_OPS)
    assert config.compilation_config.backend == "inductor"  # mode 3: vLLM's own per-piece compiler


@pytest.mark.parametrize("mode,asked", [("FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"), ("FULL_DECODE_ONLY", None),
                                        ("FULL", None)])
def test_full_cudagraphs_that_cannot_be_lowered_are_refused(mode, asked):
    from vllm.config import CUDAGraphMode

    from kvpp_fx.integrations.vllm.setup.config import MSG_GRAPH_MODE
    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_DERIVED_FULL, Requested, configure_compilation

    config = _compiled_config(mode=3, cudagraph_mode=CUDAGraphMode[mode])
    with pytest.raises(ValueError) as err:
        configure_compilation(config, Requested(cudagraph_mode=asked))
    assert str(err.value) == MSG_DERIVED_FULL.format(mode=mode) and str(err.value).startswith(MSG_GRAPH_MODE)


def _resolved_by_vllm(architecture="DeepseekV3ForCausalLM", **compilation):
    """A config with `compilation`, through vLLM's own breakable-graph default and its piecewise
    normalisation (`VllmConfig.__post_init__`'s steps, which on vLLM CPU its platform overrides)."""
    import functools

    from vllm.config import VllmConfig

    config = _compiled_config(**compilation)
    config.model_config = types.SimpleNamespace(architectures=[architecture])
    config._uses_breakable_cudagraph_by_default = functools.partial(VllmConfig._uses_breakable_cudagraph_by_default,
                                                                    config)
    breakable = VllmConfig._maybe_enable_breakable_cudagraph(config)
    VllmConfig._normalize_piecewise_cudagraph_mode(config, breakable_cudagraph_enabled=breakable)
    return config


@pytest.fixture
def breakable_env():
    """vLLM's config sets VLLM_USE_BREAKABLE_CUDAGRAPH in the process environment for the models that
    default to breakable graphs; the test's process gets it back as it was."""
    import os

    import vllm.envs

    vllm.envs.disable_envs_cache()  # vLLM reads the variable where the test sets it, not a cached value
    before = os.environ.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)
    yield
    os.environ.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)
    if before is not None:
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = before


@pytest.mark.parametrize("architecture", ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"])
def test_models_that_default_to_breakable_graphs_resolve_to_piecewise_on_vllms_defaults(architecture, breakable_env, caplog):
    from vllm.config import CUDAGraphMode

    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_LOWERED, Requested, configure_compilation
    from kvpp_fx.integrations.vllm.plugin import breakable_cudagraphs

    assert not breakable_cudagraphs()
    config = _resolved_by_vllm(architecture, mode=3, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    # vLLM's choice for these models: breakable graphs, mode 0, FULL_AND_PIECEWISE kept.
    assert breakable_cudagraphs() and config.compilation_config.mode == 0
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    with caplog.at_level("WARNING"):
        configure_compilation(config, Requested(cudagraph_mode=None), breakable=breakable_cudagraphs())
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE and MSG_LOWERED in caplog.text
    assert Deployment.from_vllm_config(config).graph_mode == "piecewise"  # then accepted by the KVPP rules
    # FULL_AND_PIECEWISE asked for stays refused, as in mode 3.
    config = _resolved_by_vllm(architecture, mode=3, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    with pytest.raises(ValueError, match="KVPP supports eager execution or PIECEWISE only"):
        configure_compilation(config, Requested(cudagraph_mode="FULL_AND_PIECEWISE"), breakable=True)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_without_piecewise_graphs_a_full_mode_is_refused_saying_to_set_none(mode, breakable_env):
    from vllm.config import CUDAGraphMode

    from kvpp_fx.integrations.vllm.setup.config import MSG_GRAPH_MODE
    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_NO_PIECEWISE_MODE, Requested, configure_compilation

    config = _resolved_by_vllm(mode=mode, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    # vLLM's lowering outside mode 3, without breakable graphs: full graphs of decode steps only.
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    with pytest.raises(ValueError) as err:
        configure_compilation(config, Requested(cudagraph_mode=None))
    assert str(err.value) == MSG_NO_PIECEWISE_MODE.format(mode=mode, cudagraph="FULL_DECODE_ONLY")
    assert str(err.value).startswith(MSG_GRAPH_MODE) and "'cudagraph_mode': 'NONE'" in str(err.value)
    config = _resolved_by_vllm(mode=mode, cudagraph_mode=CUDAGraphMode.NONE)
    configure_compilation(config, Requested(cudagraph_mode="NONE"))
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


def test_mode_3_keeps_vllms_mla_attention_and_cache_write_as_splitting_ops(caplog):
    from vllm.config import CUDAGraphMode
    from vllm.config.vllm import enable_rope_kvcache_mla_fusion

    from kvpp_fx.integrations.vllm.setup.compile_modes import (
        KVPP_SPLITTING_OPS,
        MLA_SPLITTING_OPS,
        MSG_ADDED_MLA_OPS,
        MSG_NO_ROPE_CACHE_FUSION,
        Requested,
        configure_compilation,
    )

    users = ["vllm::unified_attention_with_output", "vllm::unified_mla_attention_with_output"]
    config = _compiled_config(mode=3, cudagraph_mode=CUDAGraphMode.PIECEWISE, splitting_ops=list(users))
    config.compilation_config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    # A user's list keeps the cache write in a piece, so vLLM's default turns on the rope + cache-write
    # fusion on CUDA (vLLM CPU's pass config turns it off, so it is set here as vLLM's default says).
    assert config.compilation_config.splitting_ops == users
    config.compilation_config.pass_config.fuse_rope_kvcache_cat_mla = enable_rope_kvcache_mla_fusion(config)
    assert config.compilation_config.pass_config.fuse_rope_kvcache_cat_mla
    with caplog.at_level("WARNING"):
        configure_compilation(config, Requested(cudagraph_mode="PIECEWISE"))
    assert config.compilation_config.splitting_ops == users + ["vllm::unified_mla_kv_cache_update",
                                                               *KVPP_SPLITTING_OPS]
    assert set(MLA_SPLITTING_OPS) <= set(config.compilation_config.splitting_ops)
    assert config.compilation_config.splitting_ops_contain_kv_cache_update() is False  # MHA's write: not KVPP's
    assert not config.compilation_config.pass_config.fuse_rope_kvcache_cat_mla
    assert MSG_ADDED_MLA_OPS.format(ops=["vllm::unified_mla_kv_cache_update"]) in caplog.text
    assert MSG_NO_ROPE_CACHE_FUSION in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        configure_compilation(config, Requested(cudagraph_mode="PIECEWISE"))  # resolved again: unchanged, quiet
    assert config.compilation_config.splitting_ops.count("vllm::unified_mla_kv_cache_update") == 1
    assert "KVPP" not in caplog.text


def test_attention_quant_fusion_is_refused_in_mode_3():
    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_ATTN_FUSION, Requested, configure_compilation

    from vllm.config import CUDAGraphMode

    config = _compiled_config(mode=3, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                              pass_config={"fuse_attn_quant": True})
    config.compilation_config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert config.compilation_config.splitting_ops == []  # vLLM's: attention inside a piece, FULL graphs
    with pytest.raises(ValueError) as err:
        configure_compilation(config, Requested(cudagraph_mode=None))
    assert str(err.value) == MSG_ATTN_FUSION


def test_inductor_graph_partition_is_refused():
    from kvpp_fx.integrations.vllm.setup.compile_modes import MSG_GRAPH_PARTITION, Requested, configure_compilation

    config = _compiled_config(mode=3, use_inductor_graph_partition=True)
    with pytest.raises(ValueError) as err:
        configure_compilation(config, Requested(cudagraph_mode=None))
    assert str(err.value) == MSG_GRAPH_PARTITION


@pytest.mark.parametrize("backend,inner", [("inductor", "inductor"), ("eager", "eager"), ("aot_eager", "aot_eager")])
def test_modes_1_and_2_compile_through_the_kvpp_backend(backend, inner):
    from kvpp_fx.integrations.vllm.setup.compile_modes import (KVPP_BACKEND, Requested, configure_compilation,
                                                               inner_backend)

    for mode in (1, 2):
        config = _compiled_config(mode=mode, backend=backend)
        configure_compilation(config, Requested(cudagraph_mode=None))
        assert config.compilation_config.backend == KVPP_BACKEND
        assert inner_backend(config) == inner
        configure_compilation(config, Requested(cudagraph_mode=None))  # resolved again: unchanged
        assert (config.compilation_config.backend, inner_backend(config)) == (KVPP_BACKEND, inner)


def test_the_compile_digest_covers_the_passes(tmp_path):
    import shutil

    from kvpp_fx.integrations.vllm.setup.compile_modes import compile_digest
    from kvpp_fx.passes.sources import PACKAGE_ROOT
    from kvpp_fx.passes.sources import source_uuid as digest_of

    copy = tmp_path / "kvpp_fx"
    shutil.copytree(PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert digest_of(copy) == compile_digest()
    insert = copy / "passes" / "insert.py"
    insert.write_text(insert.read_text() + "\n# changed\n")
    assert digest_of(copy) != compile_digest()
    (copy / "runtime" / "stats.py").write_text("# the runtime does not decide what a graph holds\n")
    insert.write_text((PACKAGE_ROOT / "passes" / "insert.py").read_text())
    assert digest_of(copy) == compile_digest()


def test_kvpp_workers_build_vllms_backend_as_the_kvpp_subclass():
    from vllm.compilation import backends
    from vllm.config import CompilationMode, VllmConfig

    from kvpp_fx.integrations.vllm.attention.compilation import install_vllm_backend, kvpp_vllm_backend_class

    original = backends.VllmBackend
    try:
        install_vllm_backend()
        ours = kvpp_vllm_backend_class()
        assert backends.VllmBackend is ours and issubclass(ours, original)
        config = VllmConfig()
        config.compilation_config.mode = CompilationMode.VLLM_COMPILE  # vLLM CPU resolves mode 3 into 2
        # vLLM's own choice of backend, at the place it builds the model's.
        assert type(config.compilation_config.init_backend(config)) is ours
        install_vllm_backend()  # a second engine in the process: still one subclass of vLLM's class
        assert backends.VllmBackend is ours and ours.__mro__[1] is original
    finally:
        backends.VllmBackend = original


# --- breakable CUDA graphs -----------------------------------------------------------------------------


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


def test_a_device_api_that_does_not_load_leaves_the_engine_its_runtime():
    """``kvpp_set_device_api`` builds the new runtime before it closes the old one: a factory that does not
    import raises, and the engine keeps its open runtime and its device API (a closed one would fail every
    later step). The control: a factory that loads replaces the runtime and closes the old one."""
    from kvpp_fx.integrations.vllm.cache import allocation
    from kvpp_fx.integrations.vllm.engine.state import Communication, EngineState, Layout
    from kvpp_fx.runtime.runtime import KVPPRuntime
    from tests.passes import toy

    plan = toy.toy_plan(4)
    hf = types.SimpleNamespace(num_attention_heads=4, kv_lora_rank=8, qk_rope_head_dim=4)
    vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_text_config=hf, dtype=torch.float32))
    runtime = KVPPRuntime.create(plan, toy.allocate(plan))
    state = EngineState(ON, vllm_config, comm=Communication(runtime=runtime),
                        layout=Layout(vplan=types.SimpleNamespace(plan=plan)))
    with pytest.raises(ModuleNotFoundError):
        allocation.set_device_api(state, "tests.support.no_such_module:api")
    assert state.comm.runtime is runtime and not runtime._closed and state.comm.device_api_factory is None
    allocation.set_device_api(state, "tests.support.faults:UnremappedTables")
    assert state.comm.runtime is not runtime and runtime._closed and not state.comm.runtime._closed
    assert state.comm.device_api_factory == "tests.support.faults:UnremappedTables"
    state.comm.runtime.close()


# --- owner calls on the GPU MLA kernels ------------------------------------------------------------------


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
    owner = owner_metadata("FLASH_ATTN_MLA", vllms)
    assert owner.decode.scheduler_metadata is None and owner.decode.block_table is decode.block_table
    assert vllms.decode.scheduler_metadata is not None  # vLLM's object is not changed
    assert owner_metadata("TRITON_MLA", metadata) is metadata and owner_metadata("CPU_MLA", metadata) is metadata


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
    owner = state.step.owner_metadata("FLASHMLA", first)
    assert isinstance(owner.decode.scheduler_metadata, FlashMLASchedMeta)
    assert owner.decode.scheduler_metadata is not first.decode.scheduler_metadata
    assert owner.decode.block_table is first.decode.block_table and owner.num_decodes == 2
    assert state.step.owner_metadata("FLASHMLA", first) is owner  # every owner call of the step
    state.step.begin()  # the next step (`step.step_forward`)
    second = step_metadata()
    assert (state.step.owner_metadata("FLASHMLA", second).decode.scheduler_metadata
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
        return out, torch.zeros(b, h_q, s_q), torch.zeros(1, 8, dtype=torch.int32), torch.zeros(b + 1, dtype=torch.int32)

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
                             state.step.owner_metadata("FLASHMLA", metadata), heads)
        assert own.shape == (2, heads, 512) and out.shape == (2, heads * group, 512)
    assert calls == [heads, heads * group, heads * group] * 2
    # The control: the owner call given the step's own metadata, planned for the rank's heads.
    with pytest.raises(AssertionError, match="sched_meta.config.h_q must be equal to num_heads_q"):
        owner_call("FLASHMLA", forward_mqa, torch.zeros(2, heads * group, 576, dtype=torch.bfloat16), metadata, heads)


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
    assert "quantizes the queries" in owner_blocker("FLASHMLA", quantized_queries=True)
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


# --- KV connectors on a KVPP prefill node -------------------------------------------------------------------


def _transfer(**fields):
    from vllm.config import KVTransferConfig

    return types.SimpleNamespace(kv_transfer_config=KVTransferConfig(**fields))


def test_each_kvpp_connector_is_vllms_class_of_that_name():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvpp_fx.integrations.vllm import connectors
    from kvpp_fx.integrations.vllm.kv_connectors.base import KVPPConnector

    # The module vLLM's factory reads names exactly KVPP's classes of these connectors.
    assert sorted(connectors.__all__) == sorted(KVPP_VLLM_CONNECTORS)
    for name in KVPP_VLLM_CONNECTORS:
        ours = getattr(connectors, name)
        assert issubclass(ours, KVConnectorFactory.get_connector_class_by_name(name)), name
        assert issubclass(ours, KVPPConnector)
    assert connectors.NixlPullConnector is connectors.NixlConnector  # vLLM's NixlConnector is its pull connector


def test_routing_has_vllms_factory_build_kvpps_class():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvpp_fx.integrations.vllm import connectors
    from kvpp_fx.integrations.vllm.kv_connectors.routing import route_connector

    config = _transfer(kv_connector="ExampleConnector", kv_role="kv_producer")
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is not connectors.ExampleConnector
    route_connector(config)
    assert config.kv_transfer_config.kv_connector_module_path == KVPP_CONNECTOR_MODULE
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is connectors.ExampleConnector
    ON.validate(Deployment.from_vllm_config(config))  # the second validation, after routing


def test_a_connector_module_must_hold_a_kvpp_connector():
    from kvpp_fx.integrations.vllm.kv_connectors.routing import route_connector

    vllms = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
    config = _transfer(kv_connector="ExampleConnector", kv_role="kv_producer", kv_connector_module_path=vllms)
    with pytest.raises(ValueError) as err:
        route_connector(config)
    assert str(err.value) == MSG_NOT_KVPP_CONNECTOR.format(name="ExampleConnector", module=vllms)
    # A subclass of KVPP's (the PD test's fault connector) is left as named.
    faulty = _transfer(kv_connector="ExampleConnector", kv_role="kv_producer",
                       kv_connector_module_path="tests.support.connectors")
    route_connector(faulty)
    assert faulty.kv_transfer_config.kv_connector_module_path == "tests.support.connectors"


@pytest.mark.parametrize("role,message", [("kv_both", MSG_PRODUCER_ONLY.format(name="ExampleConnector")),
                                          ("kv_consumer", MSG_DECODE_NODE)])
def test_a_kvpp_connector_runs_only_on_a_producer(role, message):
    with pytest.raises(ValueError) as err:
        ON.validate(Deployment.from_vllm_config(_transfer(kv_connector="ExampleConnector", kv_role=role)))
    assert str(err.value) == message


def test_a_layer_is_exposed_by_its_owner_and_a_draft_layer_by_the_first_rank():
    from kvpp_fx.integrations.vllm.engine.state import Communication, EngineState, Layout
    from kvpp_fx.integrations.vllm.kv_connectors import base

    specs = {attn(i): mla() for i in range(5)}  # 4 target layers and a draft layer (index 4)
    vplan = plan_from_specs(specs, 2, 4)
    exposed = {}
    for rank in (0, 1):
        # The connector reads only the rank of the engine's runtime.
        state = EngineState(ON, None, layout=Layout(vplan=vplan),
                            comm=Communication(runtime=types.SimpleNamespace(rank=rank)))
        with state.active():
            exposed[rank] = [i for i in range(5) if base.kept_here("ExampleConnector", attn(i))]
            with pytest.raises(base.KVPPConnectorError, match="plan does not hold"):
                base.kept_here("ExampleConnector", attn(9))
    assert exposed == {0: [0, 1, 4], 1: [2, 3]}
    with pytest.raises(base.KVPPConnectorError, match="outside a KVPP step"):
        base.kept_here("ExampleConnector", attn(0))
    # A connector of an engine with KVPP on asks; with KVPP off (a decode instance) every layer is its own.
    on, off = base.KVPPConnector(), base.KVPPConnector()
    for connector, enabled in ((on, True), (off, False)):
        connector._vllm_config = types.SimpleNamespace(
            additional_config={"enable_kvpp": enabled}, parallel_config=types.SimpleNamespace(tensor_parallel_size=2))
    assert off.exposes(attn(0))
    with pytest.raises(base.KVPPConnectorError, match="outside a KVPP step"):
        on.exposes(attn(0))


def test_a_nixl_rank_that_names_some_layers_is_read_as_one_with_all():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlAgentMetadata

    from kvpp_fx.integrations.vllm.kv_connectors.nixl import padded_to

    names = [attn(i) for i in range(4)]
    # Rank 1 of a KVPP prefill instance: layers 2 and 3, one region each.
    meta = NixlAgentMetadata(
        engine_id="prefill", agent_metadata=b"", kv_caches_base_addr=[2000, 3000], device_id=0, num_blocks=8,
        block_lens=[9216, 9216], block_strides=[9216, 9216], kv_cache_layout="NHD", block_size=16, ssm_sizes=(0, 0),
        attn_backend_name="CPU_MLA", physical_blocks_per_logical_kv_block=1, region_num_blocks=[8, 8],
        region_group_ids=[0, 0], region_names=names[2:], region_mem_types=["DRAM", "DRAM"],
        region_members=[[names[2]], [names[3]]])
    padded = padded_to(meta, names)
    assert padded.region_names == names and padded.region_members == [[n] for n in names]
    # Layers 0 and 1 repeat its first region (never addressed: no read of this rank selects them).
    assert padded.kv_caches_base_addr == [2000, 2000, 2000, 3000]
    assert padded.block_lens == padded.block_strides == [9216] * 4
    assert padded.region_num_blocks == [8] * 4 and padded.region_mem_types == ["DRAM"] * 4
    assert meta.region_names == names[2:]  # the remote's own metadata is left as it came


def test_a_kvpp_nixl_reader_handshakes_with_every_remote_rank():
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology

    from kvpp_fx.integrations.vllm.kv_connectors.base import AllRanksTopology

    fields = dict(tp_rank=1, tp_size=2, block_size=16, engine_id="decode", is_mla=True, is_mamba=False,
                  total_num_kv_heads=1, attn_backends=[])
    assert TransferTopology(**fields).handshake_target_ranks(2) == [1]  # vLLM: MLA reads one rank
    assert AllRanksTopology(**fields).handshake_target_ranks(2) == [0, 1]
    assert AllRanksTopology(**dict(fields, tp_rank=0, tp_size=1)).handshake_target_ranks(4) == [0, 1, 2, 3]


def test_a_retyped_topology_keeps_every_field_of_vllms():
    """The NIXL and Mooncake workers' topologies are vLLM's, retyped: every field vLLM's `TransferTopology`
    declares keeps its value. The control: a class that is not a topology is refused."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology

    from kvpp_fx.integrations.vllm.kv_connectors.base import AllRanksTopology, retyped_topology
    from kvpp_fx.integrations.vllm.kv_connectors.mooncake import _ReaderTopology

    vllms = TransferTopology(tp_rank=1, tp_size=2, block_size=16, engine_id="decode", is_mla=True, is_mamba=False,
                             total_num_kv_heads=1, attn_backends=[])
    for cls in (AllRanksTopology, _ReaderTopology):
        retyped = retyped_topology(vllms, cls)
        assert type(retyped) is cls
        assert {f.name: getattr(retyped, f.name) for f in dataclasses.fields(TransferTopology)} == {
            f.name: getattr(vllms, f.name) for f in dataclasses.fields(TransferTopology)}
    with pytest.raises(TypeError, match="not a subclass"):
        retyped_topology(vllms, dict)


def test_amx_mlas_token_table_follows_the_remapped_block_table():
    import dataclasses

    from vllm.v1.attention.backends.mla.amx_mla import _expand_block_table

    from kvpp_fx.integrations.vllm.attention.packed_metadata import PackedMetadataError, _with_backend_attributes

    @dataclasses.dataclass
    class Prefill:  # the field the remap rewrites; AMX_MLA's builder adds the rest as attributes
        block_table: torch.Tensor

    original = Prefill(torch.tensor([[5, 9], [7, 0]], dtype=torch.int32))
    original.req_to_token = _expand_block_table(original.block_table, 16).to(torch.int64)
    original.extend_start_loc = torch.tensor([0, 3])
    remapped = dataclasses.replace(original, block_table=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32))
    out = _with_backend_attributes(original, remapped, 16, 3)
    assert torch.equal(out.req_to_token, _expand_block_table(remapped.block_table, 16).to(torch.int64))
    assert out.req_to_token.dtype == torch.int64 and out.extend_start_loc is original.extend_start_loc
    assert torch.equal(original.req_to_token, _expand_block_table(original.block_table, 16).to(torch.int64))
    original.block_ids_of_its_own = torch.tensor([9])  # an attribute KVPP does not know: refused by name
    with pytest.raises(PackedMetadataError, match="block_ids_of_its_own"):
        _with_backend_attributes(original, dataclasses.replace(original), 16, 3)


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


def test_a_kvpp_mooncake_reader_marks_requests_it_asks_of_every_prefill_rank_and_vllm_ignores_the_mark():
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as vllm_mooncake

    from kvpp_fx.integrations.vllm.kv_connectors import mooncake

    meta = vllm_mooncake.MooncakeXferMetadata(
        remote_hostname="127.0.0.1", remote_port=1, remote_tp_size=2, remote_tp_rank=1,
        req_blocks={"r": ("t", [[3, 4]])}, kv_caches_base_addr=[64], block_lens=[8], kv_block_lens=[8])
    encoder = mooncake._EveryRankEncoder(msgspec.msgpack.Encoder())
    kvpp_decoder = msgspec.msgpack.Decoder(mooncake.EveryRankXferMetadata)
    vllm_decoder = msgspec.msgpack.Decoder(vllm_mooncake.MooncakeXferMetadata)
    assert kvpp_decoder.decode(encoder.encode(meta)).asks_every_rank is False
    token = mooncake._ASKS_EVERY_RANK.set(True)
    try:
        marked = encoder.encode(meta)
    finally:
        mooncake._ASKS_EVERY_RANK.reset(token)
    assert kvpp_decoder.decode(marked).asks_every_rank is True
    assert vllm_decoder.decode(marked) == meta
