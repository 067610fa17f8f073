"""The integration's pure parts, without vLLM: layer tables for vLLM's graphs and worker class names."""

import pytest
import torch

from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec
from kvpp_fx.integrations.vllm.attention.compilation import KVPPCompileError, graph_layers, schedule_for
from kvpp_fx.integrations.vllm.engine.state import (
    KVPPHookError,
    hooked_worker_qualname,
    wrapped_worker_qualname,
)
from kvpp_fx.passes.registry import AttentionOpSpec, LayerResolutionError
from tests.support.specs import TOY_VLLM_SPEC, toy_spec


def plan_with_mtp() -> KVPPPlan:
    spec = toy_spec(4, drafts=1, block_size=16, components=(ComponentSpec("kv", "bfloat16", (576,)),))
    return KVPPPlan(spec, group_size=2)


def names(*layers):
    return {f"model.layers.{i}.self_attn.attn": i for i in layers}


def test_target_graph_uses_the_whole_plan():
    plan = plan_with_mtp()
    table = schedule_for(names(0, 1, 2, 3), plan, names(0, 1, 2, 3, 4))
    assert table.target_layers == (0, 1, 2, 3) and table.draft_layers == (4,)
    assert [table.slot(i) for i in range(4)] == [0, 1, 0, 1]
    assert dict(table.names) == names(0, 1, 2, 3, 4)


def test_drafter_graph_gets_no_kvpp_ops():
    table = schedule_for(names(4), plan_with_mtp(), names(0, 1, 2, 3, 4))
    assert table.target_layers == () and table.draft_layers == (4,)


def test_kvpp_off_graph_gets_no_kvpp_ops():
    table = schedule_for(names(0, 1), None)
    assert table.target_layers == () and table.draft_layers == (0, 1)
    assert dict(table.names) == names(0, 1)


def vllm_style_graph(*layers) -> torch.fx.GraphModule:
    import tests.passes.toy  # noqa: F401  (defines toy_vllm::unified_attention)

    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    for i in layers:
        q = graph.call_function(torch.ops.toy_vllm.unified_attention, (q, f"model.layers.{i}.self_attn.attn"))
    graph.output(q)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_graph_layers_match_as_the_passes_do():
    gm = vllm_style_graph(0, 3)
    assert graph_layers(gm) == {}  # vLLM's own ops only, by default
    assert graph_layers(gm, specs=(TOY_VLLM_SPEC,)) == names(0, 3)
    # The op and its default overload both named: the overload's spec wins, as in the insert pass and the
    # verifier (the op's spec here reads the layer from the wrong argument, and would fail).
    wrong = AttentionOpSpec("toy_vllm::unified_attention", ("q", 0), "name")
    default = AttentionOpSpec("toy_vllm::unified_attention.default", TOY_VLLM_SPEC.layer_arg, "name")
    for specs in ((wrong, default), (default, wrong)):
        assert graph_layers(gm, specs=specs) == names(0, 3)
    with pytest.raises(LayerResolutionError, match="cannot read a constant from node 'q'"):
        graph_layers(gm, specs=(wrong,))  # control


def test_a_graph_layer_outside_the_plan_is_refused():
    with pytest.raises(KVPPCompileError, match=r"layers \[7\]"):
        schedule_for(names(0, 7), plan_with_mtp())


def test_worker_class_names_round_trip():
    name = hooked_worker_qualname("vllm.v1.worker.gpu_worker.Worker")
    assert name == "kvpp_fx.integrations.vllm.engine.worker.KVPPWorker__vllm__v1__worker__gpu_worker__Worker"
    assert hooked_worker_qualname(name) == name  # __post_init__ may run again on the same config
    assert wrapped_worker_qualname(name.rsplit(".", 1)[1]) == "vllm.v1.worker.gpu_worker.Worker"
    with pytest.raises(KVPPHookError):
        hooked_worker_qualname("pkg.__private.Worker")


def test_eager_attention_outside_a_forward_raises_unless_passing_through():
    import torch

    from kvpp_fx.integrations.vllm.engine.state import EngineState
    from kvpp_fx.integrations.vllm.attention.model_hooks import waiting_class
    from kvpp_fx.runtime.graph_ops import passthrough
    from kvpp_fx.runtime.errors import NoActiveForwardError

    class Attention(torch.nn.Module):
        def forward(self, x):
            return x + 1

    module = waiting_class(Attention)()
    module._kvpp_engine = EngineState(config=None, vllm_config=None)
    module._kvpp_layer = 2
    with pytest.raises(NoActiveForwardError, match="layer 2's attention ran outside"):
        module(torch.zeros(1))
    with passthrough():  # dummy and profile runs
        assert module(torch.zeros(1)).item() == 1


def tiny_vllm_plans(slot_blocks: int):
    """The tiny test model's layout at TP 2 (6 layers of 16 x 576 float32 per block): compact slots of
    `slot_blocks` blocks, and whole-layer slots."""
    from kvpp_fx.integrations.vllm.cache.specs import VllmPlan

    spec = toy_spec(6, block_size=16, components=(ComponentSpec("kv", "float32", (576,)),))
    compact = KVPPPlan(spec, group_size=2, scratch_blocks=slot_blocks, request_blocks=48)
    return VllmPlan(compact, {}, {}, {}), VllmPlan(compact.whole_layer(), {}, {}, {})


def test_vllm_takes_compact_slots_where_they_hold_more_blocks():
    from kvpp_fx.integrations.vllm.cache.scratch import ScratchLayoutError, choose_plan

    page, mib = 16 * 576 * 4, 1 << 20
    compact, whole = tiny_vllm_plans(96)
    # 32 MiB: 3 persistent buffers (2 MiB aligned) beside two 4 MiB slots hold 227 blocks, beside two
    # whole-layer slots 170.
    assert (compact.plan.num_blocks(32 * mib), whole.plan.num_blocks(32 * mib)) == (8 * mib // page, 170)
    chosen, why = choose_plan(compact, whole, 32 * mib, explicit=False)
    assert chosen is compact and "compact slots of 96 blocks: 227 blocks per rank" in why
    # 16 MiB: 56 blocks either way, and slots of 96 blocks are wider than that pool; 12 MiB: the two
    # slots leave no 2 MiB buffer for an owned layer.
    chosen, why = choose_plan(compact, whole, 16 * mib, explicit=False)
    assert chosen is whole and "scratch slots of 96 blocks are wider than the pool of 56 blocks" in why
    with pytest.raises(ScratchLayoutError, match="kvpp_scratch_blocks=96: the pool of 0 blocks .* holds no other"):
        choose_plan(compact, whole, 12 * mib, explicit=True)
    # Slots of 48 blocks: 113 blocks at 20 MiB, as whole-layer slots hold (a tie keeps those), 113
    # against 56 at 16 MiB.
    small, _ = tiny_vllm_plans(48)
    chosen, why = choose_plan(small, whole, 20 * mib, explicit=False)
    assert chosen is whole and "whole-layer slots hold 113 blocks per rank, compact slots of 48 blocks 113" in why
    assert choose_plan(small, whole, 16 * mib, explicit=False)[0] is small
    # An explicit S is taken where it fits, even where whole-layer slots would hold more.
    assert choose_plan(small, whole, 20 * mib, explicit=True)[0] is small


def test_compact_slots_need_every_history_row_to_be_sheddable_or_streamed():
    """Where prefill history streams from the owners, chunked prefill, prefix caching, a long-prefill
    threshold and speculative decoding keep compact slots; where it cannot, each is named as the blocker."""
    from types import SimpleNamespace as NS

    from kvpp_fx.integrations.vllm.cache.scratch import compact_blocker

    def config(**changes):
        base = dict(model_config=NS(use_mla=True, is_hybrid=False, hf_config=NS()), speculative_config=None,
                    scheduler_config=NS(enable_chunked_prefill=False), cache_config=NS(enable_prefix_caching=False),
                    parallel_config=NS(use_ubatching=False))
        return NS(**{**base, **changes})

    defaults = config(speculative_config=NS(method="mtp"), scheduler_config=NS(enable_chunked_prefill=True,
                      long_prefill_token_threshold=256), cache_config=NS(enable_prefix_caching=True))
    assert compact_blocker(config(), None, streams_history=False) is None
    assert compact_blocker(defaults, None, streams_history=True) is None
    history = {
        "speculative decoding is on": config(speculative_config=NS(method="mtp")),
        "chunked prefill is on": config(scheduler_config=NS(enable_chunked_prefill=True)),
        "long_prefill_token_threshold is set": config(scheduler_config=NS(enable_chunked_prefill=False,
                                                                          long_prefill_token_threshold=256)),
        "prefix caching is on": config(cache_config=NS(enable_prefix_caching=True)),
    }
    for reason, vllm_config in history.items():
        why = compact_blocker(vllm_config, None, streams_history=False)
        assert reason in why and "reads prefill history only from its cache" in why, reason
        assert compact_blocker(vllm_config, None, streams_history=True) is None, reason
    always = {
        "decode rows cannot go to their owners (backend X)": (config(), "backend X"),
        "a KV connector is set": (config(kv_transfer_config=NS(kv_connector="MooncakeConnectorV2")), None),
        "micro-batching (DBO) is on": (config(parallel_config=NS(use_ubatching=True)), None),
    }
    for reason, (vllm_config, owner_blocker) in always.items():
        assert reason in compact_blocker(vllm_config, owner_blocker, streams_history=True), reason


def test_an_sfa_model_takes_owner_only_slots_unless_it_starts_broadcasting():
    """An SFA model on a backend that runs sparse owner calls takes owner-only slots of one block, whatever its
    prefill features (no step reads a slot); broadcast mode at start, a KV connector, micro-batching, a backend
    without owner calls, compiled pieces and what the loaded attention forbids keep whole-layer slots, each
    named; an explicit kvpp_scratch_blocks is refused."""
    from types import SimpleNamespace as NS

    from kvpp_fx.integrations.vllm.cache.scratch import (OWNER_ONLY_SLOT_BLOCKS, compact_blocker, config_blocker,
                                                         owner_only, slot_blocks)
    from kvpp_fx.integrations.vllm.setup.config import KVPPConfig

    def config(index_topk=8, **changes):
        base = dict(model_config=NS(use_mla=True, is_hybrid=False, hf_config=NS(index_topk=index_topk),
                                    max_model_len=4096),
                    speculative_config=NS(method="mtp"), cache_config=NS(enable_prefix_caching=True),
                    scheduler_config=NS(enable_chunked_prefill=True, max_num_batched_tokens=2048),
                    parallel_config=NS(use_ubatching=False), compilation_config=NS(mode=0))
        return NS(**{**base, **changes})

    sfa, dense = config(), config(index_topk=None)
    assert owner_only(sfa) and not owner_only(dense)
    for mode in ("auto", "owner"):
        assert compact_blocker(sfa, None, streams_history=False, mode=mode) is None, mode
    assert slot_blocks(sfa, KVPPConfig(enable_kvpp=True, tp=2), 64) == OWNER_ONLY_SLOT_BLOCKS == 1
    assert slot_blocks(dense, KVPPConfig(enable_kvpp=True, tp=2), 64) == 4096 // 64 + 2048 // 64
    assert "reads prefill history only from its cache" in compact_blocker(dense, None, streams_history=False)
    whole = {
        "kvpp_mode is 'broadcast' at start": (sfa, None, "broadcast"),
        "a KV connector is set": (config(kv_transfer_config=NS(kv_connector="NixlConnector")), None, "auto"),
        "micro-batching (DBO) is on": (config(parallel_config=NS(use_ubatching=True)), None, "auto"),
        "compile mode 3: the indexer runs inside compiled pieces": (config(compilation_config=NS(mode=3)), None,
                                                                    "owner"),
        "decode rows cannot go to their owners (the model is SFA: X)": (sfa, "the model is SFA: X", "owner"),
    }
    for reason, (vllm_config, owner_blocker, mode) in whole.items():
        assert reason in compact_blocker(vllm_config, owner_blocker, streams_history=True, mode=mode), reason
    # what the loaded attention forbids (`model_hooks.owner_only_hazard`, cases_breakable_graphs) keeps them too,
    # and means nothing for a dense model
    assert compact_blocker(sfa, None, streams_history=True, owner_only_hazard="hazard H") == "hazard H"
    assert compact_blocker(dense, None, streams_history=True, owner_only_hazard="hazard H") is None
    assert "the model is SFA" in config_blocker(sfa)  # what an explicit kvpp_scratch_blocks is refused with
