"""Which resolved vLLM configurations KVPP can run, read from vLLM's own config objects.

Invariant: an accepted configuration runs every target layer's attention with the kvpp ops, either
through the eager hooks (compilation mode 0) or through the kvpp backend (modes 1 and 2, with
``VLLM_USE_AOT_COMPILE=0``) on vLLM's V1 model runner, on a platform kvpp-fx hooks. Everything else
raises `ValueError` at ``LLM(...)`` construction with a message that says what to set.
"""

from __future__ import annotations

from typing import Any

KVPP_BACKEND = "kvpp_fx.integrations.vllm.backend"
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
MSG_MODE_3 = (
    "KVPP cannot run under compilation mode 3 (VLLM_COMPILE): vLLM's backend would compile and capture "
    "attention without the kvpp ops. Use enforce_eager=True, or compilation_config={{'mode': 2, "
    "'backend': '{backend}'}} with VLLM_USE_AOT_COMPILE=0."
)
MSG_BACKEND = (
    "KVPP under compilation mode {mode} needs compilation_config['backend'] = '{backend}', got {got!r}: "
    "any other backend runs attention without the kvpp ops. Or use enforce_eager=True."
)
MSG_AOT = (
    "KVPP's compiled path needs VLLM_USE_AOT_COMPILE=0: an AOT-compiled graph can be loaded from vLLM's "
    "cache without passing through the kvpp backend."
)
MSG_V2_RUNNER = (
    "KVPP hooks vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0 to run KVPP on this platform."
)


def is_ascend(platform: Any) -> bool:
    return (getattr(platform, "device_name", None) == "npu"
            or type(platform).__module__.split(".")[0] == "vllm_ascend")


def check_requested(vllm_config: Any) -> None:
    """Rules on the configuration as given: platforms rewrite some settings (vLLM's CPU platform turns
    mode 3 into mode 2) and the refusal must name what the user asked for."""
    if int(getattr(vllm_config.compilation_config, "mode", None) or 0) == 3:
        raise ValueError(MSG_MODE_3.format(backend=KVPP_BACKEND))


def check_version(version: str) -> None:
    from packaging.version import Version

    if tuple(Version(version).release[:2]) not in SUPPORTED_RELEASES:
        raise ValueError(MSG_VERSION.format(supported=SUPPORTED_VLLM, found=version))


def check_execution(vllm_config: Any, platform: Any = None, aot_compile: bool | None = None,
                    version: str | None = None) -> None:
    """Raise `ValueError` unless attention would run with the kvpp ops under `vllm_config` (resolved).

    `platform`, `aot_compile` and `version` default to vLLM's ``current_platform``,
    ``VLLM_USE_AOT_COMPILE`` and ``vllm.__version__``.
    """
    if platform is None:
        from vllm.platforms import current_platform as platform
    if is_ascend(platform):
        raise ValueError(MSG_ASCEND)
    if version is None:
        import vllm

        version = vllm.__version__
    check_version(version)
    compilation = vllm_config.compilation_config
    mode = int(compilation.mode or 0)
    if mode == 3:
        raise ValueError(MSG_MODE_3.format(backend=KVPP_BACKEND))
    if mode in (1, 2):
        if compilation.backend != KVPP_BACKEND:
            raise ValueError(MSG_BACKEND.format(mode=mode, backend=KVPP_BACKEND, got=compilation.backend))
        if aot_compile is None:
            from vllm import envs

            aot_compile = bool(envs.VLLM_USE_AOT_COMPILE)
        if aot_compile:
            raise ValueError(MSG_AOT)
    if vllm_config.use_v2_model_runner:
        raise ValueError(MSG_V2_RUNNER)
