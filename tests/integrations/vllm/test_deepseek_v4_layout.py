"""DeepSeek-V4's per-rank cache layout (`cache.deepseek_v4`), on the groups vLLM 0.32 forms for the tiny model
(read from its engine at TP 2: `test_vllm_deepseek_v4.py` checks the strides there), without vLLM."""

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
