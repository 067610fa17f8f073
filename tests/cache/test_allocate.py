import pytest
import torch

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec

MiB = 2**20


def sfa_spec(num_layers=10, drafts=1, block_size=16):
    comps = (ComponentSpec("kv", "bfloat16", (576,)), ComponentSpec("indexer", "int8", (128,)),
             ComponentSpec("indexer_scale", "float32", (1,)))
    layers = [LayerCacheSpec(i, comps) for i in range(num_layers)]
    layers += [LayerCacheSpec(num_layers + j, comps, is_draft=True) for j in range(drafts)]
    return ModelCacheSpec("sfa", block_size, tuple(layers))


@pytest.mark.parametrize("size,rank", [(2, 0), (2, 1), (4, 3), (1, 0)])
def test_allocates_owned_drafts_and_scratch_only(size, rank):
    plan = KVPPPlan(sfa_spec(), group_size=size)
    nb = plan.num_blocks(64 * MiB, rank)
    storage = allocate_cache(plan, rank, nb)
    assert storage.persistent_layers == tuple(sorted(plan.owned_layers(rank) + plan.local_draft_layers))
    assert len(storage.scratch) == (2 if size > 1 else 0)
    assert storage.allocated_bytes == plan.bytes_for(nb, rank) <= 64 * MiB
    for buf in list(storage.persistent.values()) + list(storage.scratch):
        assert buf.numel() % (2 * MiB) == 0
        assert int(buf.count_nonzero()) == 0


def test_typed_views_shapes_and_dtypes():
    plan = KVPPPlan(sfa_spec(), group_size=2)
    storage = allocate_cache(plan, 0, 7)
    views = storage.typed_views(9)
    assert views["kv"].shape == (7, 16, 576) and views["kv"].dtype == torch.bfloat16
    assert views["indexer"].shape == (7, 16, 128) and views["indexer"].dtype == torch.int8
    assert views["indexer_scale"].shape == (7, 16, 1) and views["indexer_scale"].dtype == torch.float32
    byte_view = storage.byte_view(9)
    assert byte_view.is_contiguous() and byte_view.numel() == 7 * plan.bundle_bytes_per_block(9)
    base = byte_view.data_ptr()
    for comp in plan.layout(9, 7):
        assert views[comp.name].data_ptr() == base + comp.offset


def test_writes_are_shared_only_between_layers_of_the_same_slot():
    plan = KVPPPlan(sfa_spec(), group_size=2)
    storage = allocate_cache(plan, 0, 5)  # rank 0 owns 0-4; 5-9 are in scratch slots 1,0,1,0,1
    storage.typed_views(9)["kv"].fill_(3.0)
    storage.typed_views(9)["indexer_scale"].fill_(7.0)
    for layer in range(11):
        kv = storage.typed_views(layer)["kv"]
        shares = layer in (5, 7, 9)  # slot 1 on rank 0
        assert bool((kv == 3.0).all()) is shares, layer
        assert bool((storage.typed_views(layer)["indexer_scale"] == 7.0).all()) is shares


def test_budget_fits_alignment_included():
    plan = KVPPPlan(sfa_spec(block_size=64), group_size=4)
    for avail in (3 * MiB, 40 * MiB, 97 * MiB + 12345):
        for rank in range(4):
            nb = plan.num_blocks(avail, rank)
            if nb == 0:
                continue
            assert allocate_cache(plan, rank, nb).allocated_bytes <= avail
            assert plan.bytes_for(nb + 1, rank) > avail


def test_rejects_empty_cache():
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        allocate_cache(KVPPPlan(sfa_spec(), group_size=2), 0, 0)
