"""The toy cache spec the runtime, pass and reference tests share: one fp32 component per layer; its
plan; and the op specs of the toy models (`TOY_SPECS`, what the pass tests give their backends and
configurations: the reference model's ops, which the toy MLA models call, and the vLLM-style toy op)."""

from __future__ import annotations

from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.schedule import LayerSchedule
from kvpp_fx.passes.pass_config import PassConfig
from kvpp_fx.passes.registry import AttentionOpSpec
from kvpp_fx.reference.ops import REFERENCE_SPECS

TOY_WIDTH, TOY_BLOCK = 8, 4  # values per token, tokens per block


def toy_spec(num_layers: int = 4, drafts: int = 0, *, width: int = TOY_WIDTH, block_size: int = TOY_BLOCK,
             components: tuple[ComponentSpec, ...] | None = None, name: str = "toy") -> ModelCacheSpec:
    """`num_layers` target layers, then `drafts` draft layers, each with one fp32 "kv" component of
    `width` values per token (or the given `components`)."""
    comps = components if components is not None else (ComponentSpec("kv", "float32", (width,)),)
    layers = [LayerCacheSpec(i, comps) for i in range(num_layers)]
    layers += [LayerCacheSpec(num_layers + j, comps, is_draft=True) for j in range(drafts)]
    return ModelCacheSpec(name, block_size, tuple(layers))


def toy_plan(num_layers: int = 4, drafts: int = 0, *, group_size: int = 1, width: int = TOY_WIDTH,
             block_size: int = TOY_BLOCK, **plan_options) -> KVPPPlan:
    """`KVPPPlan` over `toy_spec`; ``plan_options`` go to the plan (depth, layers, scratch_blocks)."""
    return KVPPPlan(toy_spec(num_layers, drafts, width=width, block_size=block_size), group_size=group_size,
                    **plan_options)


# tests/passes/toy.py defines the op; its spec is data, so it lives here with the others.
TOY_VLLM_SPEC = AttentionOpSpec("toy_vllm::unified_attention", ("layer_name", 1), "name")
TOY_SPECS = REFERENCE_SPECS + (TOY_VLLM_SPEC,)


def pass_config(plan_or_table: KVPPPlan | LayerSchedule, specs: tuple[AttentionOpSpec, ...] = TOY_SPECS,
                **options) -> PassConfig:
    """The passes' configuration for a test: the toy op specs unless told otherwise."""
    return PassConfig.build(plan_or_table, specs=specs, **options)
