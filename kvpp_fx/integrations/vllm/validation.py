"""Which platforms, vLLM releases and model runners kvpp-fx's hooks reach, read from vLLM's objects.

Invariant: an accepted configuration runs on vLLM's V1 model runner of a supported release, on a
platform kvpp-fx hooks (CPU or CUDA); how each compilation mode then runs the kvpp ops is
`compile_modes`. Everything else raises `ValueError` at ``LLM(...)`` construction with a message that
says what to set.
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
MSG_V2_RUNNER = (
    "KVPP hooks vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0 to run KVPP on this platform."
)


def is_ascend(platform: Any) -> bool:
    return (getattr(platform, "device_name", None) == "npu"
            or type(platform).__module__.split(".")[0] == "vllm_ascend")


def check_version(version: str) -> None:
    from packaging.version import Version

    if tuple(Version(version).release[:2]) not in SUPPORTED_RELEASES:
        raise ValueError(MSG_VERSION.format(supported=SUPPORTED_VLLM, found=version))


def check_execution(vllm_config: Any, platform: Any = None, version: str | None = None) -> None:
    """Raise `ValueError` unless kvpp-fx's hooks reach the platform and model runner `vllm_config`
    (resolved) runs on. `platform` and `version` default to vLLM's ``current_platform`` and
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
    if vllm_config.use_v2_model_runner:
        raise ValueError(MSG_V2_RUNNER)
