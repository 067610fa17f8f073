"""Blocks per rank with KVPP vs replicated at equal memory: compact scratch against whole-layer slots.

Measured by the real allocator (each rank's cache really allocated for the largest block count that
fits the budget, the ratio taken at the worst rank, as the engine uses one block count everywhere):

- the reference `small` preset (8 layers) at TP 2 and TP 4, 1 GiB per rank, with slots of S blocks from
  a max model length of 8192 and a token budget of 512 (S = 544), and with whole-layer slots;
- the vLLM tests' tiny DeepSeek model (6 layers of fp32 latents, block 16) at TP 2 in 32 MiB per rank:
  with its MTP layer (local on every rank), whole-layer slots and compact ones at a max model length and
  budget of 256 (the vLLM integration takes whichever holds more: MTP's verification rows stream their
  history, `integrations/vllm/attention/context_stream.py`); without it, as the owner-mode
  tests run it (64 MiB, max model length 768, vLLM CPU's budget of 2048: S = 176), compact slots (what
  the integration allocates there on CPU_MLA, `integrations/vllm/cache/scratch.py`) and whole-layer ones;
- the same model as the engines of vLLM's defaults run it in the tests (`streamed_runs`: chunked prefill
  and prefix caching on, a 128-token budget, a max model length of 512, 64 MiB per rank: S = 40), with
  its MTP layer and without: compact slots, since prefill history streams from the owners. The vLLM
  ratios are against vLLM's own replicated count (unpadded per-layer tensors, as the tests check).

Planned by `kvpp-fx plan` (TP 8, 64 GiB per rank, block 128, bf16, token budget 8192): DeepSeek-V3, Kimi-K2
and DeepSeek-V3.2 at max model lengths of 32K and 128K, and without a bound; DeepSeek-V3 with MTP too.
Beside each, what vLLM's defaults (chunked prefill, prefix caching, and MTP where planned) get on
FLASHMLA and FLASH_ATTN_MLA (`vllm_defaults`).
DeepSeek-V4-Flash (`kvpp_fx.cache.layer_caches`: five caches per layer in vLLM's packed pool, every row on its
layer's owner, so no slots) at TP 8, 64 GiB per rank, fp8_ds_mla: vLLM's blocks and the requests per rank of 128K
and 1M tokens, replicated and KVPP, and the bytes a decode token reads against what owner mode ships.
Each ratio is set next to the formula L / ceil(L/N) * (1 - depth * S * b / M) (whole-layer slots:
L / (ceil(L/N) + depth)).

    python benchmarks/capacity.py [--kv-memory 1GiB]
"""

from __future__ import annotations

import argparse
import gc
import sys

from _common import write_result

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.layer_caches import LayerCachesPlan, deepseek_v4_caches, layer_caches_report
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import PRESETS as MODEL_PRESETS
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.cli.byte_sizes import format_bytes, parse_bytes
from kvpp_fx.cli.plan_report import build_plan, vllm_backends
from kvpp_fx.reference.config import PRESETS

REFERENCE_MAX_MODEL_LEN, REFERENCE_BUDGET = 8192, 512
VLLM_TINY_MAX_MODEL_LEN, VLLM_TINY_BUDGET = 256, 256
# tests/integrations/vllm/test_vllm_owner.py's compact engines: vLLM CPU sets CPU_MLA's token budget to
# max(max_model_len, 2048), 64 MiB per rank
VLLM_TINY_COMPACT_MAX_MODEL_LEN, VLLM_TINY_COMPACT_BUDGET, VLLM_TINY_COMPACT_MEMORY = 768, 2048, 64 << 20
# tests/integrations/vllm/test_vllm_streamed.py's engines of vLLM's defaults (chunked prefill and prefix caching on)
VLLM_TINY_DEFAULTS_MAX_MODEL_LEN, VLLM_TINY_DEFAULTS_BUDGET, VLLM_TINY_DEFAULTS_MEMORY = 512, 128, 64 << 20
DEFAULTS_BACKENDS = ("FLASHMLA", "FLASH_ATTN_MLA")
PLANS = ("deepseek-v3", "kimi-k2", "deepseek-v3.2-exp")
PLAN_MEMORY = "64GiB"


def measured_blocks(plan: KVPPPlan, rank: int, budget: int) -> tuple[int, int]:
    blocks = min(plan.num_blocks(budget, rank), plan.num_blocks(budget))
    storage = allocate_cache(plan, rank, blocks)
    allocated = storage.allocated_bytes
    del storage
    gc.collect()
    if allocated > budget:
        raise AssertionError(f"rank {rank} allocated {allocated} > budget {budget}")
    return blocks, allocated


def measured(spec: ModelCacheSpec, tp: int, budget: int, max_model_len: int, token_budget: int,
             replicated: int | None = None) -> dict:
    """`replicated`: the replicated engine's own block count, where it is not KVPP's allocator at group
    size 1 (vLLM's unpadded per-layer tensors)."""
    if replicated is None:
        replicated, _ = measured_blocks(KVPPPlan(spec, group_size=1), 0, budget)
    row = {"tp": tp, "replicated_blocks": replicated, "max_model_len": max_model_len, "token_budget": token_budget}
    for label, plan in (("compact", KVPPPlan.for_requests(spec, tp, max_model_len=max_model_len,
                                                          token_budget=token_budget)),
                        ("whole_layer", KVPPPlan(spec, group_size=tp))):
        per_rank = [measured_blocks(plan, rank, budget) for rank in range(tp)]
        worst = min(b for b, _ in per_rank)
        plan.check_pool(worst)
        row[label] = {"blocks_per_rank": [b for b, _ in per_rank], "allocated_bytes_per_rank": [a for _, a in per_rank],
                      "measured_ratio": worst / replicated, "formula_ratio": plan.formula_capacity_ratio(budget),
                      "slot_blocks": plan.slot_blocks(worst)}
    return row


def vllm_tiny_spec(mtp: bool = True) -> ModelCacheSpec:
    """The cache vLLM reports for tests/integrations/vllm/tiny_model.py: 6 MLA layers and (with MTP) one MTP
    layer of 576 float32 values per token, 16 tokens per block."""
    def layer(index: int, draft: bool) -> LayerCacheSpec:
        return LayerCacheSpec(index, (ComponentSpec("kv", "float32", (576,)),), is_draft=draft)

    return ModelCacheSpec("vllm-tiny-deepseek", 16, tuple(layer(i, i == 6) for i in range(7 if mtp else 6)))


def planned(model: str, max_model_len: int | None, mtp: bool = False) -> dict:
    budget = parse_bytes(PLAN_MEMORY)
    plan = build_plan(model, tp=8, block_size=128, mtp=mtp, max_model_len=max_model_len,
                      token_budget=8192 if max_model_len else None)
    row = {"model": model, "mtp": mtp, "max_model_len": max_model_len, "slot_blocks": plan.scratch_blocks,
           "capacity_ratio": plan.capacity_ratio(budget), "formula_ratio": plan.formula_capacity_ratio(budget),
           "whole_layer_ratio": plan.whole_layer().capacity_ratio(budget)}
    if plan.compact:
        backends = vllm_backends(plan, budget)
        row["vllm_defaults"] = {name: {"slots": backends[name]["slots"],
                                       "capacity_ratio": backends[name]["capacity_ratio"]}
                                for name in DEFAULTS_BACKENDS}
    return row


def planned_layer_caches(model: str = "deepseek-v4-flash") -> dict:
    budget = parse_bytes(PLAN_MEMORY)
    plan = LayerCachesPlan(deepseek_v4_caches(MODEL_PRESETS[model], name=model), 8)
    report = layer_caches_report(plan, budget)
    return {"model": model, "kv_dtype": report["kv_dtype"], "capacity_ratio": report["capacity_ratio"],
            "packed_block_bytes": report["packed_block_bytes"],
            "worst_rank_block_bytes": max(r["block_bytes"] for r in report["ranks"]),
            "owner_exchange_bytes_per_layer": report["owner_exchange_bytes_per_layer"],
            "contexts": [{key: at[key] for key in ("context_tokens", "blocks_per_request", "replicated_requests",
                                                   "kvpp_requests", "decode_read_bytes")}
                         for at in report["contexts"]]}


def _ratio(backend: dict) -> str:
    return "-" if backend["capacity_ratio"] is None else f"{backend['capacity_ratio']:.3f}x ({backend['slots']} slots)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    budget = parse_bytes(args.kv_memory)
    spec = PRESETS["small"].cache_spec(block_size=16)
    reference = [measured(spec, tp, budget, REFERENCE_MAX_MODEL_LEN, REFERENCE_BUDGET) for tp in (2, 4)]
    for row in reference:
        print(f"small TP{row['tp']}: compact {row['compact']['measured_ratio']:.3f}x (formula "
              f"{row['compact']['formula_ratio']:.3f}x, S = {row['compact']['slot_blocks']}), whole-layer slots "
              f"{row['whole_layer']['measured_ratio']:.3f}x at {format_bytes(budget)} per rank")
    tiny_budget = 32 << 20
    # vLLM's replicated cache: one unpadded tensor of num_blocks pages per layer
    page = vllm_tiny_spec().layers[0].bytes_per_block(16)
    tiny = measured(vllm_tiny_spec(), 2, tiny_budget, VLLM_TINY_MAX_MODEL_LEN, VLLM_TINY_BUDGET,
                    replicated=tiny_budget // (7 * page))
    print(f"vLLM tiny DeepSeek with MTP TP2 in 32 MiB: whole-layer slots {tiny['whole_layer']['measured_ratio']:.3f}x, "
          f"compact {tiny['compact']['measured_ratio']:.3f}x (S = {tiny['compact']['slot_blocks']})")
    tiny_compact = measured(vllm_tiny_spec(mtp=False), 2, VLLM_TINY_COMPACT_MEMORY, VLLM_TINY_COMPACT_MAX_MODEL_LEN,
                            VLLM_TINY_COMPACT_BUDGET, replicated=VLLM_TINY_COMPACT_MEMORY // (6 * page))
    print(f"vLLM tiny DeepSeek TP2 in 64 MiB: compact {tiny_compact['compact']['measured_ratio']:.3f}x (S = "
          f"{tiny_compact['compact']['slot_blocks']}), whole-layer slots "
          f"{tiny_compact['whole_layer']['measured_ratio']:.3f}x")
    defaults = {}
    for mtp in (True, False):
        spec_ = vllm_tiny_spec(mtp=mtp)
        defaults["mtp" if mtp else "no_mtp"] = measured(
            spec_, 2, VLLM_TINY_DEFAULTS_MEMORY, VLLM_TINY_DEFAULTS_MAX_MODEL_LEN, VLLM_TINY_DEFAULTS_BUDGET,
            replicated=VLLM_TINY_DEFAULTS_MEMORY // (len(spec_.layers) * page))
    for name, row in defaults.items():
        print(f"vLLM tiny DeepSeek {name} TP2 in 64 MiB with vLLM's defaults (chunked prefill, prefix caching): "
              "compact "
              f"{row['compact']['measured_ratio']:.3f}x (S = {row['compact']['slot_blocks']}), whole-layer slots "
              f"{row['whole_layer']['measured_ratio']:.3f}x")
    plans = [planned(model, length) for model in PLANS for length in (32768, 131072, None)]
    plans += [planned("deepseek-v3", length, mtp=True) for length in (131072, None)]
    for p in plans:
        print(f"kvpp-fx plan {p['model']}{' --mtp' if p['mtp'] else ''} TP8 {PLAN_MEMORY} max_model_len "
              f"{p['max_model_len']}: {p['capacity_ratio']:.3f}x (formula {p['formula_ratio']:.3f}x; whole-layer "
              f"slots {p['whole_layer_ratio']:.3f}x)"
              + "".join(f"; vLLM defaults {n} {_ratio(d)}" for n, d in p.get("vllm_defaults", {}).items()))
    v4 = planned_layer_caches()
    print(f"kvpp-fx plan {v4['model']} TP8 {PLAN_MEMORY}: {v4['capacity_ratio']:.3f}x vLLM's blocks; requests per rank "
          + ", ".join(f"{at['replicated_requests']} -> {at['kvpp_requests']} at {at['context_tokens'] // 1024}K"
                      for at in v4["contexts"]))
    write_result("capacity", {"layer_caches_plans": [v4],
                              "kv_memory_bytes": budget, "reference": reference, "vllm_tiny": tiny,
                              "vllm_tiny_compact": tiny_compact,
                              "vllm_tiny_defaults": defaults,
                              "vllm_tiny_defaults_kv_memory_bytes": VLLM_TINY_DEFAULTS_MEMORY,
                              "vllm_tiny_compact_kv_memory_bytes": VLLM_TINY_COMPACT_MEMORY,
                              "vllm_tiny_kv_memory_bytes": tiny_budget, "plans": plans,
                              "plan_kv_memory_bytes": parse_bytes(PLAN_MEMORY)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
