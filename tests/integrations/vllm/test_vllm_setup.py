"""The plugin and vLLM's config: nothing replaced with KVPP off, every config refused or accepted at
construction, and the graph checks (vLLM's op names, vLLM's split of a rewritten graph); no engine
generates here.
"""

import json

import pytest

from kvpp_fx.integrations.vllm.setup.config import (
    KVPP_CONNECTOR_MODULE,
    MSG_DCP,
    MSG_DECODE_NODE,
    MSG_GRAPH_MODE,
    MSG_NOT_KVPP_CONNECTOR,
    MSG_PRODUCER_ONLY,
    MSG_SPEC_METHOD,
    MSG_SPEC_TOKENS,
    MSG_VLLM_CONNECTOR,
)
from kvpp_fx.integrations.vllm.setup.compile_modes import KVPP_BACKEND, MSG_BACKEND, TORCH_BACKENDS, compile_digest
from kvpp_fx.integrations.vllm.setup.validation import DEEPSEEK_V4_REFUSALS, MSG_DEEPSEEK_V4
from tests.integrations.vllm.engine_runs import CPU_WORKER, KVPP_CPU_WORKER, MTP, NO_HISTORY_ROWS, run_check

pytestmark = pytest.mark.vllm


def test_plugin_is_harmless_when_off(tiny_deepseek):
    result = run_check("plugin_off", tiny_deepseek)
    assert result["plugin_loaded"] and result["config_wrapped"]
    clean = {"replaced": [], "platform_modules": [], "kvpp_modules": []}
    assert result["after_plugins"] == clean
    assert result["after_off_config"] == clean and result["off_worker_cls"] == CPU_WORKER
    # KVPP on only renames the worker class: the engine process still imports no worker module.
    assert result["after_on_config"] == clean and result["on_worker_cls"] == KVPP_CPU_WORKER
    # The control: importing vLLM's CPU worker module does replace them, and the check sees it.
    assert "torch.cuda.Event" in result["after_cpu_worker_import"]["replaced"]
    assert "vllm.v1.worker.cpu_worker" in result["after_cpu_worker_import"]["platform_modules"]


def _on(**args):
    return {"args": {"tensor_parallel_size": 2, "additional_config": {"enable_kvpp": True}, **args}}


def _v4_refusal(key, **values):
    what, fix = DEEPSEEK_V4_REFUSALS[key]
    return MSG_DEEPSEEK_V4.format(what=what.format(**values), fix=fix)


def test_configs_at_construction(tiny_deepseek, tiny_deepseek_v4_config):
    """vLLM's defaults with only enable_kvpp run; every config under which attention would run without
    kvpp ops fails at construction with a message that says what to set."""
    eager = dict(model=tiny_deepseek, enforce_eager=True)
    base = dict(model=tiny_deepseek)
    cases = {
        "maybe": {"args": dict(eager, additional_config={"enable_kvpp": "maybe"})},
        "bad-mode": _on(**eager, additional_config={"enable_kvpp": True, "kvpp_mode": "sideways"}),
        "unknown-key": _on(**eager, additional_config={"enable_kvpp": True, "kvpp_mod": "owner"}),
        "unknown-key-off": {"args": dict(eager, additional_config={"enable_kvpp_owner": True})},
        "owner-mode": _on(**eager, additional_config={"enable_kvpp": True, "kvpp_mode": "owner"}),
        "full-graph": _on(**base, compilation_config={"cudagraph_mode": "FULL"}),
        "full-and-piecewise-asked": _on(**base, compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"}),
        "dcp": _on(**eager, decode_context_parallel_size=2),
        "custom-backend": _on(**base, compilation_config={"mode": 2, "backend": "my_pkg.my_backend"}),
        "connector": _on(**eager, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}),
        "nixl-push-producer": _on(**eager, kv_transfer_config={"kv_connector": "NixlPushConnector",
                                                               "kv_role": "kv_producer"}),
        "example-both": _on(**eager, kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
        "example-consumer": _on(**eager, kv_transfer_config={"kv_connector": "ExampleConnector",
                                                             "kv_role": "kv_consumer"}),
        "example-from-vllms-module": _on(**eager, kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
            "kv_connector_module_path": "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"}),
        "example-producer": _on(**eager, kv_transfer_config={"kv_connector": "ExampleConnector",
                                                             "kv_role": "kv_producer"}),
        "nixl-producer": _on(**eager, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                                          "kv_buffer_device": "cpu"}),
        "ngram": _on(**eager, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_max": 2}),
        "mtp-dynamic": _on(**eager, speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                                       "num_speculative_tokens_per_batch_size": [[1, 8, 2],
                                                                                                 [9, 4096, 1]]}),
        "defaults": _on(**base),
        "mode-3": _on(**base, compilation_config={"mode": 3}),
        "mode-2-eager": _on(**base, compilation_config={"mode": 2, "backend": "eager"}),
        "kvpp-backend": _on(**base, compilation_config={"mode": 2, "backend": KVPP_BACKEND}),
        "aot-off": {**_on(**base), "env": {"VLLM_USE_AOT_COMPILE": "0"}},
        "eager": _on(**eager, additional_config={"enable_kvpp": "true"}),
        "eager-mtp": _on(**eager, speculative_config=MTP),
        "breakable-cudagraph": {**_on(**base), "env": {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}},
        "expert-parallel": _on(**base, enable_expert_parallel=True),
        "v1": {**_on(**eager), "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}},
        "scratch-zero": _on(**eager, additional_config={"enable_kvpp": True, "kvpp_scratch_blocks": 0}),
        # vLLM's defaults with MTP: a prefill row's history streams from the owners, so S fits them
        "scratch-mtp": _on(**eager, speculative_config=MTP, additional_config={"enable_kvpp": True,
                                                                              "kvpp_scratch_blocks": 64}),
        "scratch-connector": _on(**eager, kv_transfer_config={"kv_connector": "ExampleConnector",
                                                              "kv_role": "kv_producer"},
                                 additional_config={"enable_kvpp": True, "kvpp_scratch_blocks": 64}),
        "scratch-short": _on(**eager, **NO_HISTORY_ROWS, additional_config={"enable_kvpp": True,
                                                                             "kvpp_scratch_blocks": 47}),
        "scratch": _on(**eager, **NO_HISTORY_ROWS, additional_config={"enable_kvpp": True, "kvpp_scratch_blocks": 48}),
        "off": {"args": dict(base, tensor_parallel_size=2, compilation_config={"cudagraph_mode": "FULL"})},
        "off-unset": {"args": dict(base, tensor_parallel_size=2, compilation_config={"cudagraph_mode": "FULL"},
                                   additional_config={"enable_kvpp": False})},
    }
    results = run_check("construct_many", json.dumps(cases))
    # DeepSeek-V4 in an interpreter of its own: after vLLM resolved a V4 config, the next config it resolved
    # in that interpreter came out in mode 0 (measured)
    v4_model = dict(model=tiny_deepseek_v4_config, max_model_len=4096)
    v4 = {"deepseek-v4": _on(**v4_model),
          "deepseek-v4-broadcast": _on(**v4_model, additional_config={"enable_kvpp": True, "kvpp_mode": "broadcast"}),
          "deepseek-v4-mxfp4": _on(**v4_model, attention_config={"indexer_kv_dtype": "mxfp4"}),
          # the control: vLLM builds the same model's config with KVPP off
          "deepseek-v4-off": {"args": dict(model=tiny_deepseek_v4_config, max_model_len=4096, tensor_parallel_size=2)}}
    results.update(run_check("construct_many", json.dumps(v4)))
    no_plugin = run_check("construct_many", json.dumps({"off": cases["off"]}), env={"VLLM_PLUGINS": "none"})["off"]

    refused = {
        "maybe": "additional_config.enable_kvpp must be a boolean, got 'maybe'.",
        "bad-mode": "additional_config.kvpp_mode must be one of ['broadcast', 'owner', 'auto'], got 'sideways'.",
        "unknown-key": "unknown KVPP key(s) in additional_config: ['kvpp_mod']; the known keys are "
                       "['enable_kvpp', 'kvpp_mode', 'kvpp_scratch_blocks']",
        "scratch-zero": "additional_config.kvpp_scratch_blocks must be a positive integer, got 0.",
        "scratch-connector": "additional_config.kvpp_scratch_blocks cannot run here: a KV connector is set",
        # 768 tokens in blocks of 16: 48 blocks
        "scratch-short": "additional_config.kvpp_scratch_blocks=47 holds fewer blocks than one request of "
                         "max_model_len=768 tokens needs (48 blocks of 16 tokens); set it to at least 48",
        "unknown-key-off": "unknown KVPP key(s) in additional_config: ['enable_kvpp_owner']",
        "full-graph": MSG_GRAPH_MODE,
        "full-and-piecewise-asked": MSG_GRAPH_MODE,
        "dcp": MSG_DCP,
        "custom-backend": MSG_BACKEND.format(mode=2, torch_backends=list(TORCH_BACKENDS), got="my_pkg.my_backend"),
        "connector": MSG_VLLM_CONNECTOR.format(name="OffloadingConnector"),
        "nixl-push-producer": MSG_VLLM_CONNECTOR.format(name="NixlPushConnector"),
        "example-both": MSG_PRODUCER_ONLY.format(name="ExampleConnector"),
        "example-consumer": MSG_DECODE_NODE,
        "example-from-vllms-module": MSG_NOT_KVPP_CONNECTOR.format(
            name="ExampleConnector", module="vllm.distributed.kv_transfer.kv_connector.v1.example_connector"),
        "ngram": MSG_SPEC_METHOD,
        "mtp-dynamic": MSG_SPEC_TOKENS,
        "deepseek-v4-broadcast": _v4_refusal("mode", mode="broadcast"),
        "deepseek-v4-mxfp4": _v4_refusal("indexer_dtype", dtype="mxfp4"),
    }
    for name, message in refused.items():
        assert results[name]["is_value_error"], (name, results[name])
        assert message in results[name]["message"], (name, results[name]["message"])
    # vLLM CPU runs its default (mode 3) as mode 2 with inductor: the graph goes through the kvpp pass and
    # inductor compiles the pieces, whether mode 3 is asked for or left to the default, AOT on or off.
    digest = compile_digest()
    for name, inner in (("defaults", "inductor"), ("mode-3", "inductor"), ("aot-off", "inductor"),
                        ("mode-2-eager", "eager"), ("kvpp-backend", "inductor"), ("breakable-cudagraph", None),
                        ("expert-parallel", "inductor"), ("eager", None), ("eager-mtp", None), ("owner-mode", None),
                        ("scratch", None), ("scratch-mtp", None), ("v1", None), ("example-producer", None),
                        ("nixl-producer", None)):
        result = results[name]
        assert result["error"] is None, (name, result)
        assert result["worker_cls"] == KVPP_CPU_WORKER, name
        # V2, vLLM's default wherever Triton runs, unless the user selects V1
        assert result["model_runner"] == ("V1" if name == "v1" else "V2"), name
        assert result["additional_config"]["kvpp_fx"]["digest"] == digest, name
        if inner is None:
            assert result["mode"] == 0 and "inner_backend" not in result["additional_config"]["kvpp_fx"], name
        else:
            assert (result["mode"], result["backend"]) == (2, KVPP_BACKEND), name
            assert result["additional_config"]["kvpp_fx"]["inner_backend"] == inner, name
        # vLLM resolves copies of a config again (the MTP drafter's): nothing changes the second time.
        assert result["replaced"] == {k: result[k] for k in ("mode", "backend", "additional_config")}, name
    # KVPP off: exactly vLLM's own config, as without the plugin (whatever the graph mode).
    assert results["deepseek-v4-off"]["error"] is None and results["deepseek-v4-off"]["worker_cls"] == CPU_WORKER
    # DeepSeek-V4 on vLLM CPU: KVPP's worker, whose model runner stays vLLM's
    assert results["deepseek-v4"]["error"] is None and results["deepseek-v4"]["worker_cls"] == KVPP_CPU_WORKER
    for name in ("off", "off-unset"):
        assert results[name]["error"] is None, results[name]
        assert results[name]["worker_cls"] == no_plugin["worker_cls"] == CPU_WORKER
        for key in ("mode", "backend", "cudagraph_mode"):
            assert results[name][key] == no_plugin[key]
    assert results["owner-mode"]["additional_config"]["kvpp_mode"] == "owner"
    assert results["scratch"]["additional_config"]["kvpp_scratch_blocks"] == 48
    assert results["scratch-mtp"]["additional_config"]["kvpp_scratch_blocks"] == 64
    # vLLM's connector factory builds KVPP's class of vLLM's name: the plugin names its module.
    assert results["example-producer"]["kv_connector_module_path"] == KVPP_CONNECTOR_MODULE
    assert results["nixl-producer"]["kv_connector_module_path"] == KVPP_CONNECTOR_MODULE
    assert results["off"]["kv_connector_module_path"] is None
    assert results["off"]["additional_config"] == no_plugin["additional_config"] == {}
    assert results["off"]["hash"] == no_plugin["hash"]


@pytest.fixture(scope="module")
def graph_checks():
    return run_check("graph_checks")


def test_every_builtin_vllm_spec_names_an_op_of_the_installed_vllm(graph_checks):
    result = graph_checks["spec_ops"]
    assert result["specs"], result
    missing = [op for op, exists in result["specs"].items() if not exists]
    assert not missing, f"built-in vLLM op specs name ops vLLM {result['vllm']} does not have: {missing}"
    assert "vllm::unified_mla_attention_with_output" in result["specs"]
    # The control: the check does see a missing op.
    assert result["control"] is False


def test_vllm_split_graph_keeps_kvpp_ops_in_splitting_pieces(graph_checks):
    """vLLM's own split_graph puts every kvpp op in an eager piece that takes an input (vLLM's generated
    code needs one), with the first prefetch at the first wait as mode 3 places it."""
    result = graph_checks["split"]
    assert result["splitting_ops"][-2:] == ["kvpp::prefetch", "kvpp::wait"]
    pieces = result["at_first_wait"]
    placed = [op for piece in pieces for op in piece["kvpp_ops"]]
    assert len(placed) == 8  # 4 prefetches, 4 waits
    for piece in pieces:
        if piece["kvpp_ops"]:
            assert piece["splitting"] and piece["inputs"] > 0, piece
    # The control: at graph entry, the first prefetch is an eager piece of its own without inputs.
    entry = next(piece for piece in result["entry"] if piece["kvpp_ops"])
    assert len(entry["kvpp_ops"]) == 1 and entry["splitting"] and entry["inputs"] == 0, entry
