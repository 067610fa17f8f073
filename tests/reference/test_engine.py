"""The step driver: chunked prefill, prefix reuse, decode, SFA and MTP, against full recomputation."""

import pytest
import torch

from kvpp_fx.launch import run_ranks
from kvpp_fx.reference.config import PRESETS
from kvpp_fx.reference.engine import BlockPool, EngineConfig, OutOfBlocksError, build_engine
from kvpp_fx.reference.generate import rank_groups, run_engine, run_generation
from kvpp_fx.reference.weights import build_model
from tests.reference.helpers import recompute_greedy, shared_prefix_prompts

NEW_TOKENS = 16


def run_tp1(preset, prompts, **options):
    options = {"graph_mode": "none", "token_budget": 32, **options}
    with torch.no_grad():
        return run_generation(0, 1, preset, prompts, NEW_TOKENS, options)


def expected(preset, prompts):
    model = build_model(PRESETS[preset])
    return [recompute_greedy(model, p, NEW_TOKENS) for p in prompts]


def check_workload(result, prompts):
    steps = result["steps"]
    first_prefill = [s for s in steps if any(rid == 0 and start < len(prompts[0]) for rid, start, _ in s["requests"])]
    assert len(first_prefill) >= 2, "the first prompt needs at least two prefill chunks"
    assert result["cached_tokens"][1] >= 3 * 16, "the second prompt reuses the 3-block prefix"
    assert steps[0]["has_history"] is False
    assert all(s["has_history"] for s in steps[1:])


@pytest.mark.parametrize("preset", ["tiny", "tiny-sfa"])
def test_cache_reuse_matches_recomputation(preset):
    prompts = shared_prefix_prompts(PRESETS[preset].vocab_size)
    result = run_tp1(preset, prompts)
    check_workload(result, prompts)
    assert result["outputs"] == expected(preset, prompts)
    assert all(len(o) == NEW_TOKENS for o in result["outputs"])


def generate_with(config, prompts, **options):
    engine_config = EngineConfig(graph_mode="none", token_budget=32, **options)
    with torch.no_grad():
        return run_engine(config, prompts, NEW_TOKENS, engine_config=engine_config, groups=rank_groups(0, 1),
                          kvpp=False, num_blocks=32)["outputs"]


def test_sfa_top_k_really_selects():
    cfg = PRESETS["tiny-sfa"]
    prompts = shared_prefix_prompts(cfg.vocab_size)
    assert cfg.index_topk < len(prompts[0])
    sparse = generate_with(cfg, prompts)
    dense = generate_with(cfg.replace(index_topk=4096), prompts)  # same weights, every token selected
    assert sparse != dense


def test_mtp_speculative_equals_plain_greedy():
    prompts = shared_prefix_prompts(PRESETS["tiny-mtp"].vocab_size)
    plain = run_tp1("tiny-mtp", prompts)
    spec = run_tp1("tiny-mtp", prompts, speculative=True)
    assert spec["outputs"] == plain["outputs"] == expected("tiny-mtp", prompts)
    proposed = sum(p for p, _ in spec["drafts"])
    assert proposed >= NEW_TOKENS // 2  # a draft is verified on (almost) every decode step
    check_workload(spec, prompts)


def test_mtp_accepted_drafts_give_two_tokens_per_step():
    cfg = PRESETS["tiny-mtp"]
    prompts = shared_prefix_prompts(cfg.vocab_size)
    truth = expected("tiny-mtp", prompts)
    engine = build_engine(cfg, engine_config=EngineConfig(graph_mode="none", token_budget=32, speculative=True),
                          num_blocks=32)
    propose = engine._propose

    def oracle(batch, spans, hidden):  # the real MTP runs (and fills its cache); its draft is then corrected
        propose(batch, spans, hidden)
        for item in batch:
            request = item.request
            if request.draft is not None:
                done = len(request.output)
                request.draft = truth[request.rid][done] if done < NEW_TOKENS else 0

    engine._propose = oracle
    for prompt in prompts:
        engine.add_request(prompt, NEW_TOKENS)
    with torch.no_grad():
        assert engine.run() == truth
    for request in engine.requests:
        assert request.drafts_accepted == request.drafts_proposed > 0
    decode_steps = [s for s in engine.steps if s["decode_only"]]
    assert len(decode_steps) < NEW_TOKENS  # two tokens per accepted step


@pytest.mark.multirank
def test_tp2_driver_matches_recomputation():
    prompts = shared_prefix_prompts(PRESETS["tiny"].vocab_size)
    options = {"graph_mode": "none", "token_budget": 32}
    results = run_ranks(run_generation, 2, "tiny", prompts, NEW_TOKENS, options, timeout_s=120)
    for res in results:
        check_workload(res, prompts)
        assert res["outputs"] == expected("tiny", prompts)


def test_block_pool_prefix_hits_and_eviction():
    pool = BlockPool(num_blocks=3, block_size=2)
    a = [pool.allocate() for _ in range(2)]
    for block, h in zip(a, BlockPool.chain_hashes([1, 2, 3, 4], 2)):
        pool.register(block, h)
    assert pool.match_prefix([1, 2, 3, 4, 5]) == a
    assert pool.match_prefix([1, 9, 3, 4]) == []
    pool.release(a)  # cached but free: the never-used block 2 goes first, then a[0], then a[1]
    assert pool.match_prefix([1, 2, 3, 4]) == a
    assert pool.allocate() == 2
    assert pool.allocate() == a[0]  # evicting the prefix's first block breaks the whole chain
    assert pool.match_prefix([1, 2, 3, 4]) == []
    assert pool.allocate() == a[1]
    with pytest.raises(OutOfBlocksError):
        pool.allocate()


def test_engine_rejects_bad_requests_and_modes():
    engine = build_engine(PRESETS["tiny"], engine_config=EngineConfig(graph_mode="none"), num_blocks=8)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], 4)
    with pytest.raises(ValueError, match="exceed max_model_len"):
        engine.add_request([1] * 250, 10)
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([999], 1)
    with pytest.raises(ValueError, match="speculative decoding needs"):
        build_engine(PRESETS["tiny"], engine_config=EngineConfig(speculative=True), num_blocks=8)
    with pytest.raises(ValueError, match="graph_mode must be one of"):
        EngineConfig(graph_mode="full")
    with pytest.raises(ValueError, match="kvpp_mode must be one of"):
        EngineConfig(kvpp_mode="fast")
    from kvpp_fx.reference.generate import generate

    with pytest.raises(ValueError, match="kvpp_mode must be one of"):  # refused before any rank starts
        generate("tiny", [[1, 2]], 2, tp=2, kvpp=True, kvpp_mode="fast")


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_the_engine_tells_its_runtime_how_each_compiled_graph_is_routed(declared, monkeypatch):
    if not declared:  # the attention op without its owner rule: the graphs stay broadcast-only
        import dataclasses

        import kvpp_fx.reference.engine as engine_module

        specs = tuple(dataclasses.replace(spec, owner=None) if spec.op == "kvpp_ref::mla_attention" else spec
                      for spec in engine_module.REFERENCE_SPECS)
        monkeypatch.setattr(engine_module, "REFERENCE_SPECS", specs)
    engine = build_engine(PRESETS["tiny"], engine_config=EngineConfig(graph_mode="eager"), num_blocks=16)
    assert engine.runtime.routing() == {}  # nothing compiled yet: "auto" would broadcast
    engine.add_request([1, 2, 3], 2)
    with torch.no_grad():
        engine.step()
    records = engine.backend.records
    assert records and all(record.owner_routed is declared for record in records)
    reported = {layer: record.owner_routed for record in records for layer in record.layers}
    assert engine.runtime.routing() == reported == dict.fromkeys(engine.plan.target_layers, declared)
    if not declared:
        assert engine.runtime.unrouted_layers() == list(engine.plan.target_layers)  # owner mode refused up front
