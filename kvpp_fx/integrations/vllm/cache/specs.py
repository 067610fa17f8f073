"""KVPP cache specs and plans from vLLM's own per-layer KV cache specs.

Invariants:
- Every vLLM cache layer maps to one component of the bundle of its layer index (``layers.N``): the
  MLA latent cache is component ``"kv"``, an SFA indexer cache (``cache_role`` INDEXER, named
  ``...self_attn.indexer.k_cache``) is component ``"indexer"`` of the same bundle.
- A component's per-token record is vLLM's own: ``state_content_size_bytes`` of ``dtype`` (656 bytes
  of uint8 for ``fp8_ds_mla``), and ``page_size_bytes == block_size x bytes per token`` is checked,
  never recomputed from the head size.
- Layers at index >= the target model's ``num_hidden_layers`` (MTP) are local drafts: persistent on
  every rank, never broadcast.
- Anything else (non-MLA specs, padded pages, several heads or states per token) is refused with
  `KVPPSpecError` before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import DTYPE_ITEMSIZE, ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.passes.registry import LAYER_NAME_PATTERN

MAIN_COMPONENT = "kv"
INDEXER_COMPONENT = "indexer"


class KVPPSpecError(ValueError):
    """vLLM's KV cache specs describe a cache KVPP cannot place."""


@dataclass(frozen=True)
class VllmPlan:
    """A KVPP plan plus how vLLM's cache layers map onto it."""

    plan: KVPPPlan
    layer_index: Mapping[str, int]  # vLLM layer name -> layer index (bundle)
    component: Mapping[str, str]  # vLLM layer name -> component of that bundle
    page_size_bytes: Mapping[str, int]  # vLLM's page size per layer name

    @property
    def logical_bytes_per_block(self) -> int:
        """What vLLM's planner charges per block for all its cache layers (replicated layout)."""
        return sum(self.page_size_bytes.values())


def layer_index(name: str) -> int:
    match = LAYER_NAME_PATTERN.search(name)
    if match is None:
        raise KVPPSpecError(f"cannot read a layer index from vLLM layer name {name!r}.")
    return int(match.group(1))


def dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise KVPPSpecError(f"KVPP cannot place a KV cache of dtype {name}; supported: {sorted(DTYPE_ITEMSIZE)}.")
    return name


def component_of(name: str, spec: Any) -> ComponentSpec:
    """One vLLM ``MLAAttentionSpec`` as a KVPP component (checked against vLLM's page size)."""
    kind = type(spec).__name__
    if not hasattr(spec, "cache_dtype_str") or kind not in ("MLAAttentionSpec",):
        raise KVPPSpecError(f"layer {name!r} has a {kind}; KVPP places only MLA caches (MLAAttentionSpec).")
    role = getattr(getattr(spec, "cache_role", None), "value", getattr(spec, "cache_role", None))
    component = INDEXER_COMPONENT if role == "indexer" else MAIN_COMPONENT
    if spec.num_heads != 1 or spec.tokens_per_state != 1:
        raise KVPPSpecError(f"layer {name!r}: KVPP needs one head slot and one state per token, got "
                            f"{spec.num_heads} and tokens_per_state={spec.tokens_per_state}.")
    dtype = dtype_name(spec.dtype)
    itemsize = DTYPE_ITEMSIZE[dtype]
    record = spec.state_content_size_bytes
    if record % itemsize:
        raise KVPPSpecError(f"layer {name!r}: a {record}-byte record is not a whole number of {dtype}.")
    comp = ComponentSpec(component, dtype, (record // itemsize,))
    if spec.page_size_bytes != comp.bytes_per_block(spec.block_size):
        raise KVPPSpecError(
            f"layer {name!r}: vLLM's page is {spec.page_size_bytes} bytes, but {spec.block_size} tokens of "
            f"{record} bytes make {comp.bytes_per_block(spec.block_size)} (padded pages are not supported).")
    return comp


def per_layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    """Layer name -> spec from a vLLM ``KVCacheConfig`` (UniformTypeKVCacheSpecs unpacked)."""
    specs: dict[str, Any] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)
        for name in group.layer_names:
            specs[name] = inner[name] if inner is not None else spec
    return specs


def plan_from_specs(specs: Mapping[str, Any], group_size: int, num_target_layers: int | None = None,
                    *, depth: int | None = None, scratch_blocks: int | None = None,
                    max_model_len: int | None = None) -> VllmPlan:
    """A KVPP plan from vLLM's per-layer specs (``model_runner.get_kv_cache_spec()``).

    ``num_target_layers`` is the target model's ``num_hidden_layers``: layers at or above it belong to
    the MTP drafter and stay local. None treats every layer as a target. ``scratch_blocks``: S blocks
    per scratch slot (compact slots; `scratch.slot_blocks`), None for whole-layer slots;
    ``max_model_len`` bounds the longest request (`KVPPPlan.check_pool`).
    """
    if not specs:
        raise KVPPSpecError("vLLM reported no KV cache layers.")
    block_sizes = {spec.block_size for spec in specs.values()}
    if len(block_sizes) != 1:
        raise KVPPSpecError(f"KVPP needs one block size for all layers, got {sorted(block_sizes)}.")
    bundles: dict[int, dict[str, ComponentSpec]] = {}
    index_of, component_name = {}, {}
    for name, spec in specs.items():
        index = layer_index(name)
        comp = component_of(name, spec)
        bundle = bundles.setdefault(index, {})
        if comp.name in bundle:
            other = next(n for n, i in index_of.items() if i == index and component_name[n] == comp.name)
            raise KVPPSpecError(f"layers {other!r} and {name!r} are both the {comp.name!r} cache of layer {index}.")
        bundle[comp.name] = comp
        index_of[name], component_name[name] = index, comp.name
    layers = []
    for index, bundle in sorted(bundles.items()):
        if MAIN_COMPONENT not in bundle:
            raise KVPPSpecError(f"layer {index} has an indexer cache but no MLA cache.")
        ordered = tuple(sorted(bundle.values(), key=lambda c: c.name != MAIN_COMPONENT))
        is_draft = num_target_layers is not None and index >= num_target_layers
        layers.append(LayerCacheSpec(index, ordered, is_draft=is_draft))
    spec = ModelCacheSpec("vllm", block_sizes.pop(), tuple(layers))
    options = {} if depth is None else {"depth": depth}
    request_blocks = None if max_model_len is None else -(-max_model_len // spec.block_size)
    plan = KVPPPlan(spec, group_size, scratch_blocks=scratch_blocks, request_blocks=request_blocks, **options)
    pages = {name: int(s.page_size_bytes) for name, s in specs.items()}
    return VllmPlan(plan, index_of, component_name, pages)
