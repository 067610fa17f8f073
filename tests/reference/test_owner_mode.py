"""Owner mode through the reference engine on real ranks: KVPP in broadcast, owner and auto mode against
KVPP off, step by step.

Owner mode runs each layer's attention on its owner over the heads of every rank. The reference
attention op is batched per head (one GEMM per head), so a head's result does not depend on how many
heads share the call, and every mode's logits are bit-identical to KVPP off; greedy tokens are
therefore identical too. The auto cases use a slow link model (1 GB/s, 5 us per collective), under
which a decode's blocks cost more to broadcast than its queries and outputs, and a prefill chunk's
queries cost more than the blocks it reads: auto picks per request, so steps with decodes next to a
prefill chunk are hybrid steps, and all three kinds of step appear in one run.
"""

import dataclasses

import numpy as np
import pytest
import torch

from kvpp_fx.cache.cost import LinkModel
from kvpp_fx.reference.config import PRESETS
from kvpp_fx.reference.engine import EngineConfig
from kvpp_fx.reference.generate import default_num_blocks, rank_groups, run_engine
from kvpp_fx.reference.workload import shared_prefix_prompts
from tests.support.launch import launch

pytestmark = pytest.mark.multirank

SLOW_LINK = LinkModel(bytes_per_s=1e9, latency_s=5e-6)
MODES = ("broadcast", "owner", "auto")
EVERY_TOKEN = 1 << 20  # an index top-k above every context: sparse attention over every token
FAULTS = {"swap-heads": "tests.support.faults:SwappedHeads", "skip-gather": "tests.support.faults:SkippedGather"}


def staggered_prompts(vocab: int) -> list[list[int]]:
    """A 120-token prompt, then an unrelated 60-token one, whose prefill chunks run next to the first's
    decodes over its whole history."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (120,), generator=gen).tolist(),
            torch.randint(0, vocab, (60,), generator=gen).tolist()]


WORKLOADS = {"shared_prefix": shared_prefix_prompts, "staggered": staggered_prompts}


def modes_ranks(rank: int, world: int, preset: str, options: dict, modes: tuple[str, ...], token_budget: int = 24,
                new_tokens: int = 10, workload: str = "shared_prefix"):
    """The shared-prefix workload with KVPP off, then with KVPP on in each of `modes`; per step: logits,
    mode and bytes. One KVPP group of all ranks (TP = world). A mode "owner:<fault>" runs owner mode
    over the device API `FAULTS[<fault>]`, and "off:every-token" KVPP off with a wrong top-k: every context token
    instead of the indexer's choice (negative controls)."""
    config = PRESETS[preset]
    prompts = WORKLOADS[workload](config.vocab_size)
    groups = rank_groups(rank, world)
    num_blocks = max(64, default_num_blocks(prompts, new_tokens, 16))
    out = {}
    for mode in ("off",) + tuple(modes):
        torch._dynamo.reset()
        kvpp_mode, _, fault = mode.partition(":")
        kvpp = kvpp_mode != "off"
        if fault and ((fault == "every-token") == kvpp or fault not in (*FAULTS, "every-token")):
            raise ValueError(f"mode {mode!r}: a fault of FAULTS with KVPP on, or 'off:every-token'")
        model = dataclasses.replace(config, index_topk=EVERY_TOKEN) if fault == "every-token" else config
        engine_config = EngineConfig(token_budget=token_budget, kvpp_mode=kvpp_mode if kvpp else "broadcast",
                                     device_api=FAULTS[fault] if fault in FAULTS else None, **options)
        out[mode] = run_engine(model, prompts, new_tokens, engine_config=engine_config, groups=groups,
                               kvpp=kvpp, num_blocks=num_blocks, keep_logits=True)
    return out


def run(preset, world, options, modes=MODES, workload="shared_prefix"):
    return launch(modes_ranks, world, preset, dict(options, kvpp_link=SLOW_LINK), modes, 24, 10, workload,
                  timeout_s=300)


def same_logits(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


OWNER_FAULTS = ("owner:swap-heads", "owner:skip-gather")


@pytest.mark.parametrize("preset,world,options,modes", [
    ("tiny", 2, {"graph_mode": "eager"}, MODES + OWNER_FAULTS),
    ("tiny-sfa", 2, {"graph_mode": "piecewise", "inner": "eager"}, ("owner", "auto", "off:every-token")),
    ("tiny-sfa", 4, {"graph_mode": "eager"}, ("owner", "owner:swap-heads")),
    ("tiny-mtp", 2, {"graph_mode": "piecewise", "inner": "aot_eager", "speculative": True}, ("owner",)),
], ids=["mla-tp2-eager", "sfa-tp2-piecewise", "sfa-tp4-eager", "mtp-tp2-piecewise-aot_eager"])
def test_every_mode_is_bit_identical_to_kvpp_off(preset, world, options, modes):
    """Each mode's tokens and logits against KVPP off; the negative controls too: the owner scattering each rank
    the next rank's heads, and no gather (the owner's own queries for every rank's heads), on the same ranks,
    change the outputs. On the SFA model the indexer selects (prompts longer than its top-k), so a wrong
    selection shows: attention over every context token instead changes the outputs."""
    results = run(preset, world, options, modes)
    faults = [mode for mode in modes if ":" in mode]
    modes = [mode for mode in modes if ":" not in mode]
    layers = PRESETS[preset].num_hidden_layers
    if PRESETS[preset].is_sfa:
        prompts = shared_prefix_prompts(PRESETS[preset].vocab_size)
        assert min(len(p) for p in prompts) > PRESETS[preset].index_topk
    for rank, res in enumerate(results):
        off = res["off"]
        assert off["steps"][1]["requests"][0][1] > 0, "the first prompt needs two prefill chunks"
        assert off["steps"][-1]["decode_only"]
        assert off["cached_tokens"][1] >= 48, "the second prompt hits the 3-block prefix cache"
        for mode in modes:
            on = res[mode]
            assert on["outputs"] == off["outputs"], f"rank {rank} {mode}: tokens differ"
            assert same_logits(on["logits"], off["logits"]), f"rank {rank} {mode}: logits differ"
        if "broadcast" in modes:
            assert all(s["mode"] == "broadcast" and s["exchanges"] == 0 for s in res["broadcast"]["steps"])
        for step in res["owner"]["steps"]:
            assert step["mode"] == "owner" and step["broadcasts"] == 0 and step["broadcast_bytes"] == 0, step
            assert step["exchanges"] == layers and step["owner_bytes"] > 0, step
        assert res["owner"]["stats"]["modes"] == {"broadcast": 0, "owner": len(res["owner"]["steps"]), "hybrid": 0}
        if "auto" in modes:
            # per request: decodes go to the owners, prefill chunks broadcast their history; a step with
            # both is a hybrid step unless the decodes' history is the chunk's prefix, which the broadcast
            # carries anyway (the hybrid steps: `test_hybrid_steps_are_bit_identical_to_kvpp_off`)
            auto = res["auto"]["steps"]
            for step in auto:
                if step["decode_only"]:
                    assert step["mode"] == "owner", step
                else:
                    assert step["mode"] == ("hybrid" if "owner" in step["paths"] else "broadcast"), step
                    assert step["paths"][-1] == "broadcast", step  # the prefill chunk is the last request
                if step["mode"] == "hybrid":
                    assert step["broadcasts"] == layers and step["exchanges"] == layers, step
            assert {"broadcast", "owner"} <= {s["mode"] for s in auto}
        if options.get("speculative"):
            assert sum(p for p, _ in res["owner"]["drafts"]) > 0, "MTP drafts must run (locally) in owner mode"
            assert res["owner"]["drafts"] == off["drafts"]
        for mode in faults:
            assert not same_logits(res[mode]["logits"], off["logits"]), (rank, mode)
    for mode in faults:
        assert any(res[mode]["outputs"] != res["off"]["outputs"] for res in results), mode


@pytest.mark.parametrize("preset,world,options,modes", [
    ("tiny", 4, {"graph_mode": "eager"}, ("auto", "owner", "auto:swap-heads")),
    ("tiny-sfa", 2, {"graph_mode": "piecewise", "inner": "eager"}, ("auto",)),
], ids=["mla-tp4-eager", "sfa-tp2-piecewise"])
def test_hybrid_steps_are_bit_identical_to_kvpp_off(preset, world, options, modes):
    """The second prompt's prefill chunks run next to the first's decodes: the decodes go to the owners,
    the chunks broadcast their own history, in one step; each attention call is cut by request. (TP 4
    runs owner mode on the same trace too, and the negative control: hybrid steps whose owner scatters
    each rank the next rank's heads.)"""
    results = run(preset, world, options, modes, workload="staggered")
    layers = PRESETS[preset].num_hidden_layers
    for rank, res in enumerate(results):
        off, on = res["off"], res["auto"]
        assert on["outputs"] == off["outputs"], f"rank {rank}: tokens differ"
        assert same_logits(on["logits"], off["logits"]), f"rank {rank}: logits differ"
        hybrid = [s for s in on["steps"] if s["mode"] == "hybrid"]
        assert len(hybrid) >= 2, [(s["mode"], s["paths"]) for s in on["steps"]]
        for step in hybrid:
            assert step["paths"] == ["owner", "broadcast"], step
            assert step["exchanges"] == layers and step["owner_bytes"] > 0, step
        # a later chunk broadcasts its own history while the decode's goes nowhere
        assert any(s["broadcasts"] == layers and s["broadcast_bytes"] > 0 for s in hybrid)
        if "owner" in res:
            assert res["owner"]["outputs"] == off["outputs"] and same_logits(res["owner"]["logits"], off["logits"])
            assert {s["mode"] for s in res["owner"]["steps"]} == {"owner"}
        if "auto:swap-heads" in res:
            assert not same_logits(res["auto:swap-heads"]["logits"], off["logits"])
    if "auto:swap-heads" in modes:
        assert any(res["auto:swap-heads"]["outputs"] != res["off"]["outputs"] for res in results)
