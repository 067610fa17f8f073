import types

import pytest

from kvpp_fx.integrations.vllm.setup import config as C
from kvpp_fx.integrations.vllm.setup.config import MSG_VLLM_CONNECTOR, Deployment, KVPPConfig


@pytest.mark.parametrize("raw", [True, "True", "true", "yes", "on", 1, "1"])
def test_enable_kvpp_truthy_values(raw):
    cfg = KVPPConfig.from_additional_config({"enable_kvpp": raw}, tp=4, pcp=1)
    assert cfg.enable_kvpp is True
    assert cfg.size == 4
    assert cfg.enabled


@pytest.mark.parametrize("raw", [False, "False", "FALSE", "no", "off", 0, "0"])
def test_enable_kvpp_falsy_values(raw):
    cfg = KVPPConfig.from_additional_config({"enable_kvpp": raw}, tp=4, pcp=1)
    assert cfg.enable_kvpp is False
    assert cfg.size == 1
    assert not cfg.enabled


@pytest.mark.parametrize("raw", ["maybe", 2, -1, "2", [], None, 0.5])
def test_enable_kvpp_rejects_non_booleans(raw):
    with pytest.raises(ValueError) as info:
        KVPPConfig.from_additional_config({"enable_kvpp": raw}, tp=4)
    assert str(info.value) == f"additional_config.enable_kvpp must be a boolean, got {raw!r}."


def test_missing_key_or_config_means_off():
    assert KVPPConfig.from_additional_config({}, tp=8).size == 1
    assert KVPPConfig.from_additional_config(None, tp=8).size == 1


def test_size_is_tp_times_pcp():
    cfg = KVPPConfig.from_additional_config({"enable_kvpp": True}, tp=4, pcp=2)
    assert cfg.size == 8


def test_single_rank_group_is_off():
    cfg = KVPPConfig.from_additional_config({"enable_kvpp": True}, tp=1, pcp=1)
    assert cfg.size == 1 and not cfg.enabled


@pytest.mark.parametrize("tp", [0, -2, "4", 1.5, True])
def test_bad_group_dimensions(tp):
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        KVPPConfig(enable_kvpp=True, tp=tp)


ON = KVPPConfig(enable_kvpp=True, tp=4)

# (deployment overrides, expected message): one case per rule
RULES = [
    (dict(dcp=2), "KVPP and DCP cannot be enabled at the same time."),
    (dict(kv_connector="SomeThirdPartyConnector", kv_role="kv_producer"),
     "KVPP broadcast supports only MooncakeConnectorV2 for PD disaggregation."),
    (dict(kv_connector="LMCacheConnectorV1", kv_role="kv_producer"),
     MSG_VLLM_CONNECTOR.format(name="LMCacheConnectorV1")),
    (dict(kv_connector="MooncakeStoreConnector", kv_role="kv_producer"),
     MSG_VLLM_CONNECTOR.format(name="MooncakeStoreConnector")),
    (dict(kv_connector="MooncakeConnectorV2", kv_role="kv_consumer"),
     "KVPP must be disabled on the decode-only node."),
    (dict(kv_connector="NixlPushConnector", kv_role="kv_producer"),
     MSG_VLLM_CONNECTOR.format(name="NixlPushConnector")),
    (dict(kv_connector="ExampleConnector", kv_role="kv_consumer"), "KVPP must be disabled on the decode-only node."),
    (dict(kv_connector="ExampleConnector", kv_role="kv_both"), C.MSG_PRODUCER_ONLY.format(name="ExampleConnector")),
    (dict(kv_connector="ExampleConnector"), C.MSG_PRODUCER_ONLY.format(name="ExampleConnector")),
    (dict(kv_connector="NixlConnector", kv_role="kv_producer", pp=2),
     C.MSG_NIXL_PARALLEL.format(name="NixlConnector")),
    (dict(kv_connector="NixlPullConnector", kv_role="kv_producer", pcp=2),
     C.MSG_NIXL_PARALLEL.format(name="NixlPullConnector")),
    (dict(kv_connector="MooncakeConnector", kv_role="kv_producer", pp=2),
     C.MSG_NIXL_PARALLEL.format(name="MooncakeConnector")),
    (dict(kv_connector="MooncakeConnector", kv_role="kv_both"), C.MSG_PRODUCER_ONLY.format(name="MooncakeConnector")),
    (dict(graph_mode="full"), "KVPP supports eager execution or PIECEWISE only."),
    (dict(model_kind="hybrid"), "KVPP currently supports only non-hybrid MLA models."),
    (dict(model_kind="mha"), "KVPP currently supports only non-hybrid MLA models."),
    (dict(spec_method="eagle"),
     "KVPP currently supports speculative decoding only with method='mtp' or method='dspark'."),
    (dict(spec_method="dspark", adaptive_verification=True),
     "KVPP does not support DSpark adaptive verification."),
    (dict(spec_method="mtp", spec_tokens_fixed=False),
     "KVPP currently supports only a fixed number of speculative tokens."),
]


@pytest.mark.parametrize("overrides,message", RULES, ids=[m[:30] for _, m in RULES])
def test_each_validation_message(overrides, message):
    with pytest.raises(ValueError) as info:
        ON.validate(Deployment(tp=4, **overrides))
    assert str(info.value) == message


def test_rules_apply_in_order():
    # A deployment that breaks every rule reports the first one, then the next once that is fixed.
    broken = dict(dcp=2, kv_connector="Other", graph_mode="full", model_kind="hybrid",
                  spec_method="eagle", spec_tokens_fixed=False)
    seen = []
    order = ["dcp", "kv_connector", "graph_mode", "model_kind", "spec_method", "spec_tokens_fixed"]
    fixes = dict(dcp=1, kv_connector=None, graph_mode="eager", model_kind="mla", spec_method="mtp",
                 spec_tokens_fixed=True)
    for field in order:
        with pytest.raises(ValueError) as info:
            ON.validate(Deployment(tp=4, **broken))
        seen.append(str(info.value))
        broken[field] = fixes[field]
    ON.validate(Deployment(tp=4, **broken))
    assert seen == [C.MSG_DCP, C.MSG_CONNECTOR, C.MSG_GRAPH_MODE, C.MSG_MODEL_KIND, C.MSG_SPEC_METHOD,
                    C.MSG_SPEC_TOKENS]


@pytest.mark.parametrize("ok", [
    dict(),
    dict(graph_mode="piecewise", model_kind="sfa"),
    dict(spec_method="mtp"),
    dict(spec_method="dspark"),
    dict(kv_connector="MooncakeConnectorV2", kv_role="kv_producer"),
    dict(kv_connector="MooncakeConnectorV2", kv_role="kv_both"),
    dict(kv_connector="ExampleConnector", kv_role="kv_producer"),
    dict(kv_connector="NixlConnector", kv_role="kv_producer"),
    # a connector class from a module path: the vLLM integration checks it is KVPP's
    dict(kv_connector="NixlConnector", kv_role="kv_producer", kv_connector_module_path="my_pkg.connectors"),
])
def test_supported_deployments_pass(ok):
    assert ON.validate(Deployment(tp=4, **ok)) is None
    with pytest.raises(ValueError) as info:  # control: past the rules before it, full graphs are refused
        ON.validate(Deployment(tp=4, **{**ok, "graph_mode": "full"}))
    assert str(info.value) == C.MSG_GRAPH_MODE


@pytest.mark.parametrize("overrides,message", RULES)
def test_disabled_config_accepts_everything(overrides, message):
    assert KVPPConfig(enable_kvpp=False, tp=4).validate(Deployment(tp=4, **overrides)) is None
    assert KVPPConfig(enable_kvpp=True, tp=1).validate(Deployment(**overrides)) is None
    with pytest.raises(ValueError) as info:  # control: enabled on 4 ranks, the same deployment is refused
        ON.validate(Deployment(tp=4, **overrides))
    assert str(info.value) == message


def test_validate_accepts_a_plain_dict():
    with pytest.raises(ValueError, match="KVPP and DCP"):
        ON.validate({"tp": 4, "dcp": 2})
    with pytest.raises(ValueError, match="unknown deployment fields: colour"):
        ON.validate({"tp": 4, "colour": "red"})


def test_bad_deployment_field_values_are_named():
    with pytest.raises(ValueError, match="graph_mode must be one of"):
        Deployment(graph_mode="FULL_AND_PIECEWISE")
    with pytest.raises(ValueError, match="kv_role must be one of"):
        Deployment(kv_role="consumer")
    with pytest.raises(ValueError, match="dcp must be a positive integer"):
        Deployment(dcp=0)


def _vllm_like(**kw):
    ns = types.SimpleNamespace
    return ns(
        additional_config=kw.get("additional_config", {"enable_kvpp": "yes"}),
        parallel_config=ns(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1,
                           prefill_context_parallel_size=1, decode_context_parallel_size=kw.get("dcp", 1)),
        model_config=ns(enforce_eager=kw.get("enforce_eager", True), use_mla=True, is_hybrid=False,
                        hf_config=ns()),
        compilation_config=ns(cudagraph_mode=ns(name=kw.get("cudagraph", "NONE"))),
        speculative_config=kw.get("spec"),
        kv_transfer_config=kw.get("kv"),
    )


def test_vllm_like_config_is_read_by_attribute():
    vc = _vllm_like()
    cfg = KVPPConfig.from_vllm_config(vc)
    assert cfg.size == 2
    cfg.validate(vc)
    with pytest.raises(ValueError, match="KVPP and DCP"):
        cfg.validate(_vllm_like(dcp=2))
    with pytest.raises(ValueError, match="eager execution or PIECEWISE only"):
        cfg.validate(_vllm_like(enforce_eager=False, cudagraph="FULL_AND_PIECEWISE"))
    cfg.validate(_vllm_like(enforce_eager=False, cudagraph="PIECEWISE"))
    mtp = types.SimpleNamespace(method="deepseek_mtp", num_speculative_tokens=1,
                                num_speculative_tokens_per_batch_size=None)
    cfg.validate(_vllm_like(spec=mtp))
    # vLLM's attribute names: a per-batch-size schedule is dynamic; adaptive verification is refused.
    dynamic = types.SimpleNamespace(method="mtp", num_speculative_tokens_per_batch_size=[(1, 8, 2)])
    with pytest.raises(ValueError, match="fixed number of speculative tokens"):
        cfg.validate(_vllm_like(spec=dynamic))
    adaptive = types.SimpleNamespace(method="dspark", enable_adaptive_verification=True)
    with pytest.raises(ValueError, match="adaptive verification"):
        cfg.validate(_vllm_like(spec=adaptive))
    with pytest.raises(ValueError, match="decode-only node"):
        cfg.validate(_vllm_like(kv=types.SimpleNamespace(kv_connector="MooncakeConnectorV2",
                                                         kv_role="kv_consumer")))


def test_kvpp_mode_defaults_to_auto_and_is_checked():
    assert KVPPConfig.from_additional_config({"enable_kvpp": True}).mode == "auto"
    for mode in ("broadcast", "owner", "auto"):
        assert KVPPConfig.from_additional_config({"enable_kvpp": True, "kvpp_mode": mode}).mode == mode
    with pytest.raises(ValueError, match=r"kvpp_mode must be one of \['broadcast', 'owner', 'auto'\], got 'fast'"):
        KVPPConfig.from_additional_config({"enable_kvpp": True, "kvpp_mode": "fast"})
    with pytest.raises(ValueError, match="kvpp_mode must be one of"):
        KVPPConfig(enable_kvpp=True, mode="Owner")


@pytest.mark.parametrize("key", ["kvpp_mod", "kvppmode", "enable_kvpp_owner", "kvpp_scratch_block"])
def test_unknown_kvpp_keys_are_named_even_with_kvpp_off(key):
    with pytest.raises(ValueError, match=rf"unknown KVPP key\(s\) in additional_config: \['{key}'\]; the known keys "
                                         r"are \['enable_kvpp', 'kvpp_mode', 'kvpp_scratch_blocks'\]"):
        KVPPConfig.from_additional_config({key: True})


def test_kvpp_scratch_blocks_is_a_positive_integer_or_absent():
    assert KVPPConfig.from_additional_config({"enable_kvpp": True}).scratch_blocks is None
    assert KVPPConfig.from_additional_config({"enable_kvpp": True, "kvpp_scratch_blocks": 48}).scratch_blocks == 48
    for bad in (0, -1, True, 4.0, "48"):
        with pytest.raises(ValueError, match=r"kvpp_scratch_blocks must be a positive integer, got"):
            KVPPConfig.from_additional_config({"enable_kvpp": True, "kvpp_scratch_blocks": bad})
    # other plugins' keys are theirs
    assert not KVPPConfig.from_additional_config({"ascend_scheduler_config": {}, "kvpp_fx": {}}).enabled


def test_the_supported_vllm_connectors_are_named_in_the_refusal():
    # Each of vLLM's connectors either runs on a KVPP producer or is refused with the ones that do.
    for name in C.VLLM_CONNECTORS:
        deployment = Deployment(tp=4, kv_connector=name, kv_role="kv_producer")
        if name in C.KVPP_VLLM_CONNECTORS:
            ON.validate(deployment)
            continue
        with pytest.raises(ValueError) as info:
            ON.validate(deployment)
        assert all(supported in str(info.value) for supported in C.KVPP_VLLM_CONNECTORS), name
    assert C.KVPP_VLLM_CONNECTORS and set(C.KVPP_VLLM_CONNECTORS) <= set(C.VLLM_CONNECTORS)
