"""DeepSeek-V4's KV cache with KVPP: each rank allocates the pages of the layers it holds, in vLLM's packed blocks.

vLLM 0.32 packs DeepSeek-V4's caches block-outermost: its five KV cache groups (two of window caches, the
compressed KV and indexer keys, and two of compressor states) overlay one backing allocation of
``num_blocks x block_stride`` bytes, the page of ``KVCacheTensor.layers[l]`` for block ``b`` at
``offset + l x layer_stride + b x block_stride``. A block id belongs to one group at a time, so the stride
is the largest group's sum of pages.

KVPP keeps vLLM's groups, block ids and block count on every rank, and lays each rank's blocks out with only
the pages of the layers it holds (the target layers it owns, and the MTP layers): in each group those pages
back to back from offset 0, in vLLM's order, so the rank's block stride is the largest group's sum of its
own pages (`Relayout`). The cache layers of the other layers are bound to an `AbsentCache`: owner mode never
reads them (`attention.deepseek_v4`), and a read raises, naming the layer.

Budget: a rank holding ``s_r`` bytes per block of the ``s`` vLLM packs fits ``available // s_r`` blocks; it
reports ``available // s_r x s`` bytes, so vLLM's unchanged planner gives the group the smallest block
count any rank fits. The allocation checks that vLLM's config has the stride and pages the budget assumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvpp_fx.integrations.vllm.engine.state import KVPPAllocationError


@dataclasses.dataclass(frozen=True)
class Relayout:
    """Where a rank keeps the pages of the cache layers it holds, within its blocks of `block_stride` bytes."""

    block_stride: int
    offsets: Mapping[str, int]  # cache layer name -> byte offset of its page within a block


def relayout(groups: Sequence[Sequence[str]], pages: Mapping[str, int], held: set[str]) -> Relayout:
    """The held layers of each group back to back from offset 0; the stride is the largest group's sum."""
    offsets, stride = {}, 0
    for names in groups:
        offset = 0
        for name in names:
            if name in held:
                offsets[name] = offset
                offset += pages[name]
        stride = max(stride, offset)
    return Relayout(stride, offsets)


def layer_specs(kv_cache_groups: Sequence[Any]) -> dict[str, Any]:
    """Each cache layer's own spec, from vLLM's KV cache groups."""
    out = {}
    for group in kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            out[name] = spec.kv_cache_specs[name] if hasattr(spec, "kv_cache_specs") else spec
    return out


def groups_of(vllm_config: Any, specs: Mapping[str, Any]) -> list[Any]:
    """vLLM's KV cache groups for the model's cache specs, as its engine core forms them."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    return get_kv_cache_groups(vllm_config, dict(specs))


def budget(engine: Any, vllm_config: Any, specs: Mapping[str, Any], available: int) -> int:
    """The owners, from vLLM's groups, and the bytes this rank reports for vLLM's planner (module docstring)."""
    from kvpp_fx.cache.layer_caches import balanced_group_owners

    groups = groups_of(vllm_config, specs)
    names = [list(group.layer_names) for group in groups]
    pages = {name: spec.page_size_bytes for name, spec in layer_specs(groups).items()}

    def loads(keep: Any) -> list[int]:
        return [sum(pages[name] for name in group if keep(engine.layer_of(name))) for group in names]

    owners = balanced_group_owners({layer: loads(lambda i, layer=layer: i == layer) for layer in engine.target_layers},
                                   engine.group_size, base=loads(lambda i: i is None))
    held = {name for name in pages if (layer := engine.layer_of(name)) is None or owners[layer] == engine.rank}
    packed, mine = relayout(names, pages, set(pages)), relayout(names, pages, held)
    if mine.block_stride == 0:
        raise KVPPAllocationError(f"rank {engine.rank} holds no DeepSeek-V4 cache layer: set tensor_parallel_size "
                                  f"to at most {len(engine.target_layers)}, the model's layers.")
    blocks = available // mine.block_stride
    engine.note_budget(owners, blocks, packed.block_stride, mine.block_stride, pages)
    return blocks * packed.block_stride


def allocate(engine: Any, kv_cache_config: Any, vllm_allocate: Any) -> dict[str, torch.Tensor]:
    """This rank's caches: vLLM's allocation of a config holding only the held layers, re-laid out, and an
    empty cache for every other cache layer."""
    specs = layer_specs(kv_cache_config.kv_cache_groups)
    pages = {name: spec.page_size_bytes for name, spec in specs.items()}
    strides = {tensor.block_stride for tensor in kv_cache_config.kv_cache_tensors}
    if strides != {engine.packed_stride} or pages != engine.pages:
        raise KVPPAllocationError(
            f"vLLM's DeepSeek-V4 KV cache config packs blocks of {sorted(strides)} bytes with pages {pages}; KVPP's "
            f"budget assumed {engine.packed_stride} bytes and pages {engine.pages} (vLLM grouped the engine's specs "
            "unlike the worker's).")
    num_blocks = kv_cache_config.num_blocks
    if engine.budget_blocks is not None and num_blocks > engine.budget_blocks:
        raise KVPPAllocationError(f"vLLM planned {num_blocks} blocks, the KVPP budget holds {engine.budget_blocks}: "
                                  "lower num_gpu_blocks_override or give more KV cache memory.")
    names = [list(group.layer_names) for group in kv_cache_config.kv_cache_groups]
    held = {name for name in pages if engine.holds(name)}
    mine = relayout(names, pages, held)
    if mine.block_stride != engine.rank_stride:
        raise KVPPAllocationError(
            f"vLLM's DeepSeek-V4 KV cache groups give this rank blocks of {mine.block_stride} bytes; KVPP's budget "
            f"assumed {engine.rank_stride} (vLLM grouped the engine's specs unlike the worker's).")
    tensors = [dataclasses.replace(tensor, layers=[name], size=num_blocks * mine.block_stride,
                                   layer_stride=pages[name], block_stride=mine.block_stride,
                                   offset=mine.offsets[name])
               for tensor in kv_cache_config.kv_cache_tensors for name in tensor.layers if name in held]
    caches = dict(vllm_allocate(dataclasses.replace(kv_cache_config, kv_cache_tensors=tensors)))
    for name in sorted(set(pages) - held):
        caches[name] = AbsentCache(name, engine.owner(engine.layer_of(name)))
    engine.note_allocation(num_blocks, num_blocks * mine.block_stride, held)
    return caches


class AbsentCache:
    """The cache of a layer this rank does not hold. Not a tensor, so vLLM's block zeroer passes it by; on the
    ``meta`` device, so V2's runner keeps it out of its list of caches (V1's lists it, and its copy-on-write
    would raise here); a layer binds it (``squeeze``), and anything that reads it raises, naming the layer."""

    device = torch.device("meta")

    def __init__(self, name: str, owner: int) -> None:
        self._name, self._owner = name, owner

    def squeeze(self, *args: Any) -> AbsentCache:
        return self

    def __getattr__(self, attribute: str) -> Any:
        raise KVPPAllocationError(
            f"cache layer {self._name!r} is held by rank {self._owner} of the KVPP group, not this one ({attribute!r} "
            "was read): with KVPP only a DeepSeek-V4 layer's owner reads or writes its caches.")

    def __repr__(self) -> str:
        return f"AbsentCache({self._name!r}, owner={self._owner})"
