"""DeepSeek-V4's per-rank cache layout (`cache.deepseek_v4`), on the groups vLLM 0.32 forms for the tiny model
(read from its engine at TP 2: `test_vllm_deepseek_v4.py` checks the strides there), and its allocation's
agreement across ranks, without vLLM."""

import dataclasses
from datetime import timedelta

import pytest
import torch

from kvpp_fx.integrations.vllm.cache.deepseek_v4 import AbsentCache, relayout
from kvpp_fx.integrations.vllm.engine.state import KVPPAllocationError

SWA, IDX, R4, R128, STATE, IDX_STATE = 37440, 8640, 37440, 1728, 32832, 8640
# vLLM's five groups for the layers 0 (window only), 1 and 3 (ratio 4) and 2 (ratio 128), in its order
GROUPS = [["L0.swa", "L2.swa"], ["L1.swa", "L3.swa"],
          ["L1.idx", "L1.attn", "L2.attn", "L3.idx", "L3.attn"],
          ["L1.idx.state", "L1.state", "L3.idx.state", "L3.state"], ["L2.state"]]
PAGES = {"L0.swa": SWA, "L1.swa": SWA, "L2.swa": SWA, "L3.swa": SWA, "L1.idx": IDX, "L3.idx": IDX, "L1.attn": R4,
         "L3.attn": R4, "L2.attn": R128, "L1.idx.state": IDX_STATE, "L3.idx.state": IDX_STATE, "L1.state": STATE,
         "L3.state": STATE, "L2.state": STATE}


def held(*layers):
    return {name for name in PAGES if int(name[1]) in layers}


def test_every_layer_gives_vllms_packed_block():
    packed = relayout(GROUPS, PAGES, set(PAGES))
    assert packed.block_stride == 2 * IDX + 2 * R4 + R128 == 93888  # the compressed group is the largest
    assert packed.offsets["L1.attn"] == IDX and packed.offsets["L2.attn"] == IDX + R4


def test_each_rank_packs_only_its_layers_pages_back_to_back():
    rank0, rank1 = relayout(GROUPS, PAGES, held(1, 2)), relayout(GROUPS, PAGES, held(0, 3))
    assert rank0.block_stride == IDX + R4 + R128 == 47808
    assert rank1.block_stride == IDX + R4 == 46080
    assert rank0.offsets == {"L2.swa": 0, "L1.swa": 0, "L1.idx": 0, "L1.attn": IDX, "L2.attn": IDX + R4,
                             "L1.idx.state": 0, "L1.state": IDX_STATE, "L2.state": 0}
    assert set(rank1.offsets) == held(0, 3)
    # within one group, no two held pages overlap
    for layout in (rank0, rank1):
        for names in GROUPS:
            spans = sorted((layout.offsets[n], layout.offsets[n] + PAGES[n]) for n in names if n in layout.offsets)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
            assert all(end <= layout.block_stride for _, end in spans)


def test_an_absent_cache_binds_and_refuses_every_read_by_name():
    cache = AbsentCache("model.layers.1.attn", owner=0)
    assert cache.squeeze(1) is cache and not isinstance(cache, torch.Tensor)
    assert cache.device == torch.device("meta")
    for read in (lambda c: c.shape, lambda c: c.view(2, -1), lambda c: c.data_ptr()):
        with pytest.raises(KVPPAllocationError, match=r"'model.layers.1.attn' is held by rank 0"):
            read(cache)


@dataclasses.dataclass
class _Tensor:  # the fields of vLLM 0.32's packed KVCacheTensor that the allocation reads and rewrites
    size: int
    layers: list
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclasses.dataclass
class _Config:  # vLLM's KVCacheConfig, as far as the allocation reads it
    num_blocks: int
    kv_cache_tensors: list
    kv_cache_groups: list


def allocation_ranks(rank: int, world: int, blocks_by_rank: list[int], failing_rank: int | None = None) -> str:
    """Two layers of 100-byte pages in one group, one per rank, vLLM planning 8 blocks; each rank's budget holds
    `blocks_by_rank[rank]`, and vLLM's allocation fails on `failing_rank` (as it does out of memory). What each
    rank's allocation returns or raises."""
    import types

    import torch.distributed as dist

    from kvpp_fx.integrations.vllm.engine.deepseek_v4 import DeepseekV4Engine

    names = ["model.layers.0.attn", "model.layers.1.attn"]
    hf = types.SimpleNamespace(num_hidden_layers=2)
    engine = DeepseekV4Engine(types.SimpleNamespace(size=world),
                              types.SimpleNamespace(model_config=types.SimpleNamespace(hf_text_config=hf)))
    engine.agreement_group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20), backend="gloo")
    engine.rank = rank
    engine.note_budget({0: 0, 1: 1}, blocks_by_rank[rank], 200, 100, {name: 100 for name in names})
    spec = types.SimpleNamespace(page_size_bytes=100)
    config = _Config(8, [_Tensor(8 * 200, names, 100, 200)], [types.SimpleNamespace(layer_names=names,
                                                                                    kv_cache_spec=spec)])
    def vllm_allocate(rewritten):
        if rank == failing_rank:
            raise RuntimeError("out of memory")
        return {t.layers[0]: (t.size, t.offset) for t in rewritten.kv_cache_tensors}

    try:
        caches = engine.allocate(config, vllm_allocate)
    except (KVPPAllocationError, RuntimeError) as exc:
        return f"refused: {exc}"
    return f"allocated: {sorted(caches)} {engine.allocation['allocated_bytes']}"


def test_a_refusal_on_one_rank_stops_every_rank_before_the_sinks_gather():
    """Rank 1's budget holds fewer blocks than vLLM planned, or vLLM's own allocation fails there: it raises its own
    error, and rank 0, whose allocation succeeded, raises one naming rank 1 instead of waiting in the sinks'
    gather. With both budgets large enough, both allocate (each its own layer's 100-byte page per block, the
    other's as an absent cache)."""
    from tests.support.launch import launch

    refused = launch(allocation_ranks, 2, [8, 4], timeout_s=120)
    assert refused[1].startswith("refused: vLLM planned 8 blocks, the KVPP budget holds 4"), refused[1]
    assert refused[0].startswith("refused: rank 1 of the KVPP group failed its DeepSeek-V4 KV cache"), refused[0]
    failed = launch(allocation_ranks, 2, [8, 8], 1, timeout_s=120)
    assert failed[1] == "refused: out of memory" and failed[0] == refused[0], failed
    allocated = launch(allocation_ranks, 2, [8, 8], timeout_s=120)
    assert allocated == ["allocated: ['model.layers.0.attn', 'model.layers.1.attn'] 800"] * 2, allocated
