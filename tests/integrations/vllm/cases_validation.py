"""Validation with vLLM's config objects: speculative decoding, the platform, vLLM's version, micro-batching
and DSpark.

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`: vLLM's import changes process-wide state; the name
keeps the main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import types

import pytest

from kvpp_fx.integrations.vllm.setup.config import MSG_ADAPTIVE, MSG_SPEC_TOKENS, Deployment
from tests.integrations.vllm.mla_specs import ON


def _speculative(**fields):
    # SpeculativeConfig's validation loads the draft model; the rule only reads these attributes.
    from vllm.config import SpeculativeConfig

    spec = object.__new__(SpeculativeConfig)
    defaults = dict(method="mtp", num_speculative_tokens=1, num_speculative_tokens_per_batch_size=None,
                    enable_adaptive_verification=False)
    for key, value in {**defaults, **fields}.items():
        object.__setattr__(spec, key, value)
    return types.SimpleNamespace(speculative_config=spec)


def test_speculative_rules_read_vllms_attributes():
    ON.validate(Deployment.from_vllm_config(_speculative()))
    dynamic = _speculative(num_speculative_tokens_per_batch_size=[(1, 8, 2), (9, 64, 1)])
    assert dynamic.speculative_config.uses_dynamic_speculative_decoding()
    with pytest.raises(ValueError, match=MSG_SPEC_TOKENS):
        ON.validate(Deployment.from_vllm_config(dynamic))
    adaptive = _speculative(method="dspark", enable_adaptive_verification=True)
    with pytest.raises(ValueError, match=MSG_ADAPTIVE):
        ON.validate(Deployment.from_vllm_config(adaptive))
    ON.validate(Deployment.from_vllm_config(_speculative(method="dspark")))


class MockAscendPlatform:
    """Stands in for vllm-ascend's NPU platform (NPU hardware is not available here)."""

    device_name = "npu"


def test_ascend_is_refused_with_a_pointer_to_vllm_ascend():
    from kvpp_fx.integrations.vllm.setup.validation import MSG_ASCEND, check_execution

    with pytest.raises(ValueError) as err:
        check_execution(None, platform=MockAscendPlatform())
    assert str(err.value) == MSG_ASCEND and "vllm-ascend" in MSG_ASCEND


def test_vllm_version_range():
    import vllm

    from kvpp_fx.integrations.vllm.setup.validation import MSG_VERSION, SUPPORTED_VLLM, check_version

    check_version(vllm.__version__)
    check_version("0.32.3+cpu")
    for other in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(ValueError) as err:
            check_version(other)
        assert str(err.value) == MSG_VERSION.format(supported=SUPPORTED_VLLM, found=other)


def test_dbo_and_dspark_are_refused_by_name():
    """Micro-batched steps run every layer once per micro-batch on threads of their own; DSpark drafts keep
    cache layers kvpp-fx has not placed. Both are refused at construction, whichever runner (on config
    objects: vLLM CPU turns DBO off itself, and cannot build a DSpark config without its checkpoint)."""
    from kvpp_fx.integrations.vllm.setup.validation import MSG_DBO, MSG_DSPARK, check_execution

    cpu = types.SimpleNamespace(device_name="cpu")
    plain = types.SimpleNamespace(parallel_config=types.SimpleNamespace(use_ubatching=False), speculative_config=None)
    check_execution(plain, platform=cpu)  # the control: accepted
    check_execution(types.SimpleNamespace(parallel_config=plain.parallel_config,
                                          speculative_config=types.SimpleNamespace(method="mtp")), platform=cpu)
    for config, message in ((types.SimpleNamespace(parallel_config=types.SimpleNamespace(use_ubatching=True),
                                                   speculative_config=None), MSG_DBO),
                            (types.SimpleNamespace(parallel_config=plain.parallel_config,
                                                   speculative_config=types.SimpleNamespace(method="dspark")),
                             MSG_DSPARK)):
        with pytest.raises(ValueError) as err:
            check_execution(config, platform=cpu)
        assert str(err.value) == message


def test_deepseek_v4_features_kvpp_does_not_run_are_refused_by_name():
    """DeepSeek-V4 on vLLM CPU is accepted (the control); each feature of it that KVPP does not run, another model
    of the family (its model type, or per-layer ``compress_ratios`` under another name) and another platform are
    refused by name, with what to set. DeepSeek-V3's and V3.2's configs pass the same check."""
    from vllm.platforms.cpu import CpuPlatform

    from kvpp_fx.integrations.vllm.setup.validation import (DEEPSEEK_V4_REFUSALS, MSG_DEEPSEEK_V4,
                                                            check_execution)

    cpu, cuda = CpuPlatform(), types.SimpleNamespace(device_type="cuda", device_name="cuda")

    def config(model_type="deepseek_v4", hf=None, **fields):
        model = types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type=model_type, **(hf or {})))
        return types.SimpleNamespace(**{"model_config": model, "speculative_config": None,
                                        "parallel_config": types.SimpleNamespace(use_ubatching=False), **fields})

    def message(key, **values):
        what, fix = DEEPSEEK_V4_REFUSALS[key]
        return MSG_DEEPSEEK_V4.format(what=what.format(**values), fix=fix)

    check_execution(config(), platform=cpu)
    check_execution(config(attention_config=types.SimpleNamespace(indexer_kv_dtype="fp8", hisparse_config=None),
                           additional_config={"kvpp_mode": "owner"}), platform=cpu)
    cases = (
        (config("deepseek_v41"), cpu, message("model_type", model_type="deepseek_v41")),
        (config("my_v4_finetune", {"compress_ratios": [4]}), cpu, message("model_type", model_type="my_v4_finetune")),
        (config(), cuda, message("platform", platform="cuda")),
        (config(parallel_config=types.SimpleNamespace(use_ubatching=False, prefill_context_parallel_size=2)), cpu,
         message("pcp")),
        (config(speculative_config=types.SimpleNamespace(method="mtp")), cpu, message("speculative", method="mtp")),
        (config(kv_transfer_config=types.SimpleNamespace(kv_connector="NixlConnector")), cpu,
         message("connector", connector="NixlConnector")),
        (config(attention_config=types.SimpleNamespace(indexer_kv_dtype="mxfp4", hisparse_config=None)), cpu,
         message("indexer_dtype", dtype="mxfp4")),
        (config(attention_config=types.SimpleNamespace(indexer_kv_dtype="auto", hisparse_config=object())), cpu,
         message("hisparse")),
        (config(hf={"vision_n_layers": 2}), cpu, message("vision", layers=2)),
        (config(additional_config={"kvpp_mode": "broadcast"}), cpu, message("mode", mode="broadcast")),
        (config(additional_config={"kvpp_scratch_blocks": 64}), cpu, message("scratch")),
        (config(parallel_config=types.SimpleNamespace(use_ubatching=False, pipeline_parallel_size=2)), cpu,
         message("pp")),
        (config(model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="deepseek_v4"),
                                                   hf_text_config=types.SimpleNamespace(num_hidden_layers=4)),
                parallel_config=types.SimpleNamespace(use_ubatching=False, tensor_parallel_size=8)), cpu,
         message("tp", tp=8, layers=4)),
    )
    for vllm_config, platform, expected in cases:
        with pytest.raises(ValueError) as err:
            check_execution(vllm_config, platform=platform)
        assert str(err.value) == expected
    for model_type, hf in (("deepseek_v3", {}), ("deepseek_v32", {"index_topk": 2048})):
        check_execution(config(model_type, hf), platform=cuda)
