"""Which platforms, vLLM releases and model runners kvpp-fx's hooks reach, read from vLLM's objects.

Invariant: an accepted configuration runs on vLLM's V1 or V2 model runner of a supported release, on
a platform kvpp-fx hooks (CPU or CUDA), with no feature whose steps the hooks cannot follow; how each
compilation mode then runs the kvpp ops is `compile_modes`. Everything else raises `ValueError` at
``LLM(...)`` construction with a message that says what to set.
"""

from __future__ import annotations

from typing import Any

# The vLLM releases whose worker and model runner the hooks were written against and tested with.
SUPPORTED_VLLM = ">=0.32,<0.33"
SUPPORTED_RELEASES = ((0, 32),)

MSG_VERSION = (
    "kvpp-fx's KVPP hooks support vLLM {supported}, found vLLM {found}: its worker and model runner "
    "may differ. Use a supported vLLM, or run without additional_config.enable_kvpp."
)
MSG_ASCEND = (
    "kvpp-fx does not run on Ascend NPUs: vllm-ascend has its own KVPP, switched on by the same "
    "additional_config={'enable_kvpp': true} (vllm-ascend PR #16094). Stop loading this plugin there "
    "(uninstall kvpp-fx, or list only the plugins you want in VLLM_PLUGINS)."
)
MSG_DBO = (
    "KVPP cannot run micro-batched steps (dual-batch overlap): each micro-batch runs every layer on a "
    "thread of its own, while KVPP moves each layer once per step in layer order. Set enable_dbo=False "
    "and ubatch_size=1."
)
MSG_DSPARK = (
    "KVPP with speculative method 'dspark' does not run in kvpp-fx yet: a DSpark draft model keeps "
    "context KV cache layers of its own, which kvpp-fx has not placed and tested (vLLM's CPU build cannot "
    "run a DSpark checkpoint). Use method='mtp', or run without additional_config.enable_kvpp."
)
MSG_DEEPSEEK_V4 = (
    "KVPP runs DeepSeek-V4 (model_type 'deepseek_v4') with vLLM CPU's attention only; {what}. {fix}, or run "
    "without additional_config.enable_kvpp."
)
# What of DeepSeek-V4 KVPP does not run, each as (what, what to set).
DEEPSEEK_V4_REFUSALS = {
    "model_type": ("{model_type!r} is another model of the family, whose attention kvpp-fx has not hooked",
                   "Serve model_type 'deepseek_v4'"),
    "platform": ("on {platform} vLLM runs another DeepSeek-V4 attention (FlashMLA's or FlashInfer's sparse "
                 "kernels), whose owner call kvpp-fx has not written and tested", "Run on vLLM CPU"),
    "pcp": ("prefill context parallelism splits a layer's tokens over ranks, and owner mode needs every row of "
            "a layer on its owner", "Set prefill_context_parallel_size=1"),
    "pp": ("pipeline parallelism is not run: kvpp-fx places DeepSeek-V4's layers over one TP group",
           "Set pipeline_parallel_size=1"),
    "tp": ("TP {tp} leaves a rank without a layer of the {layers}", "Set tensor_parallel_size to at most {layers}"),
    "scratch": ("additional_config.kvpp_scratch_blocks sizes scratch slots, and DeepSeek-V4 runs without any",
                "Drop kvpp_scratch_blocks"),
    "speculative": ("speculative decoding ({method}) is not run: vLLM CPU's DeepSeek-V4 indexer refuses it, so "
                    "kvpp-fx has not tested it", "Drop speculative_config"),
    "connector": ("a KV connector ({connector}) would move the caches of every layer, where each rank holds "
                  "only its own layers'", "Drop kv_transfer_config"),
    "indexer_dtype": ("its indexer cache of {dtype} is not what vLLM CPU stores (fp8 keys), so kvpp-fx has not "
                      "placed it", "Leave attention_config.indexer_kv_dtype unset"),
    "hisparse": ("HiSparse moves a layer's cold cache to host memory, which kvpp-fx does not place",
                 "Drop attention_config.hisparse_config"),
    "vision": ("its vision tower ({layers} layers) is not run with KVPP", "Serve the text model"),
    "mode": ("kvpp_mode {mode!r}: every row of a DeepSeek-V4 layer runs on its owner (its indexer picks the "
             "rows a step reads only inside the layer)", "Set additional_config.kvpp_mode to 'owner' or 'auto'"),
}
# The model types of vLLM 0.32's DeepSeek-V4 family (`vllm/transformers_utils/configs/deepseek_v4.py`, and
# V4.1's package); a config with per-layer ``compress_ratios`` is one of them under another name.
DEEPSEEK_V4_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")


def deepseek_v4_model_type(model_config: Any) -> str | None:
    """The model type when `model_config` is a DeepSeek-V4-family model (compressed, windowed MLA caches)."""
    for hf_config in (getattr(model_config, "hf_config", None), getattr(model_config, "hf_text_config", None)):
        if hf_config is None:
            continue
        model_type = getattr(hf_config, "model_type", None)
        if model_type in DEEPSEEK_V4_MODEL_TYPES or getattr(hf_config, "compress_ratios", None) is not None:
            return str(model_type) if model_type else "unnamed, with compress_ratios"
    return None


def is_ascend(platform: Any) -> bool:
    return (getattr(platform, "device_name", None) == "npu"
            or type(platform).__module__.split(".")[0] == "vllm_ascend")


def check_version(version: str) -> None:
    from packaging.version import Version

    if tuple(Version(version).release[:2]) not in SUPPORTED_RELEASES:
        raise ValueError(MSG_VERSION.format(supported=SUPPORTED_VLLM, found=version))


def check_execution(vllm_config: Any, platform: Any = None, version: str | None = None) -> None:
    """Raise `ValueError` unless kvpp-fx's hooks reach the platform, release and features `vllm_config`
    (resolved) runs with. `platform` and `version` default to vLLM's ``current_platform`` and
    ``vllm.__version__``.
    """
    if platform is None:
        from vllm.platforms import current_platform as platform
    if is_ascend(platform):
        raise ValueError(MSG_ASCEND)
    if version is None:
        import vllm

        version = vllm.__version__
    check_version(version)
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "use_ubatching", False):
        raise ValueError(MSG_DBO)
    speculative = getattr(vllm_config, "speculative_config", None)
    if getattr(speculative, "method", None) == "dspark":
        raise ValueError(MSG_DSPARK)
    model_type = deepseek_v4_model_type(getattr(vllm_config, "model_config", None))
    if model_type is not None:
        check_deepseek_v4(vllm_config, model_type, platform)


def check_deepseek_v4(vllm_config: Any, model_type: str, platform: Any) -> None:
    """Raise `ValueError` naming the first feature of this DeepSeek-V4 engine that KVPP does not run."""
    def refuse(key: str, **values: Any) -> None:
        what, fix = DEEPSEEK_V4_REFUSALS[key]
        raise ValueError(MSG_DEEPSEEK_V4.format(what=what.format(**values), fix=fix))

    if model_type != "deepseek_v4":
        refuse("model_type", model_type=model_type)
    if getattr(platform, "device_type", None) != "cpu":
        refuse("platform", platform=getattr(platform, "device_name", None) or type(platform).__name__)
    parallel = getattr(vllm_config, "parallel_config", None)
    if int(getattr(parallel, "prefill_context_parallel_size", 1) or 1) != 1:
        refuse("pcp")
    if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) != 1:
        refuse("pp")
    hf_text = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    layers = getattr(hf_text, "num_hidden_layers", None)
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    if isinstance(layers, int) and tp > layers:
        refuse("tp", tp=tp, layers=layers)
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None:
        refuse("speculative", method=getattr(speculative, "method", None))
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None:
        refuse("connector", connector=getattr(transfer, "kv_connector", None))
    attention = getattr(vllm_config, "attention_config", None)
    indexer_dtype = getattr(attention, "indexer_kv_dtype", None)
    if indexer_dtype not in (None, "auto", "fp8"):
        refuse("indexer_dtype", dtype=indexer_dtype)
    if getattr(attention, "hisparse_config", None) is not None:
        refuse("hisparse")
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    if int(getattr(hf, "vision_n_layers", 0) or 0) > 0:
        refuse("vision", layers=hf.vision_n_layers)
    additional = getattr(vllm_config, "additional_config", None) or {}
    mode = additional.get("kvpp_mode") or "auto"
    if str(mode) not in ("auto", "owner"):
        refuse("mode", mode=mode)
    if additional.get("kvpp_scratch_blocks") is not None:
        refuse("scratch")
