"""vLLM's KV cache specs read into KVPP's plan: page sizes and dtypes, the SFA indexer, MTP draft layers,
and the specs KVPP cannot place.

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`: vLLM's import changes process-wide state; the name
keeps the main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.integrations.vllm.cache.specs import KVPPSpecError, per_layer_specs, plan_from_specs
from tests.integrations.vllm.mla_specs import attn, indexer, mla


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
