"""A step's batch from vLLM's block tables: V1's tables and V2's device tables with KVPP's host mirror,
the blocks a step reads and writes, its requests, and AMX_MLA's token table after the remap.

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`: vLLM's import changes process-wide state; the name
keeps the main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import types

import numpy as np
import pytest
import torch

from kvpp_fx.integrations.vllm.engine.batch import StepBatch, active_blocks, written_blocks
from kvpp_fx.integrations.vllm.engine.runner_v1 import block_rows


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
    # a token's row is its block * 16 + its offset: blocks 0, 1 / 2, 0 after the remap, 5, 9 / 7, 0 before
    assert torch.equal(out.req_to_token, torch.tensor([[*range(0, 32)], [*range(32, 48), *range(16)]]))
    assert out.req_to_token.dtype == torch.int64 and out.extend_start_loc is original.extend_start_loc
    assert torch.equal(original.req_to_token, torch.tensor([[*range(80, 96), *range(144, 160)],
                                                            [*range(112, 128), *range(16)]]))
    original.block_ids_of_its_own = torch.tensor([9])  # an attribute KVPP does not know: refused by name
    with pytest.raises(PackedMetadataError, match="block_ids_of_its_own"):
        _with_backend_attributes(original, dataclasses.replace(original), 16, 3)


def test_a_decode_field_of_block_ids_besides_the_block_table_is_refused():
    """ROCm AITER's decode metadata carries its own page table (``paged_kv_indices``, block ids times the block
    size plus offsets), which its kernels read instead of ``block_table``: left as vLLM built it, a non-owner
    would read its packed slot at pool positions. The control: the same metadata without it passes."""
    import dataclasses

    from vllm.v1.attention.backends.mla.rocm_aiter_mla import AiterMLADecodeMetadata

    from kvpp_fx.integrations.vllm.attention.packed_metadata import PackedMetadataError, _with_backend_attributes

    table, seq_lens = torch.tensor([[5, 9]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    decode = AiterMLADecodeMetadata(table, seq_lens, None, paged_kv_indices=torch.tensor([5, 9], dtype=torch.int32))
    with pytest.raises(PackedMetadataError, match=r"layer 3: AiterMLADecodeMetadata holds block ids in "
                                                  r"\['paged_kv_indices'\] besides its block_table"):
        _with_backend_attributes(decode, dataclasses.replace(decode, block_table=table - 5), 16, 3)
    plain = dataclasses.replace(decode, paged_kv_indices=None)
    out = _with_backend_attributes(plain, dataclasses.replace(plain, block_table=table - 5), 16, 3)
    assert out.block_table.tolist() == [[0, 4]] and out.paged_kv_indices is None
