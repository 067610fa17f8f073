"""The ``vllm.general_plugins`` entry point. It runs in every vLLM process, so it stays harmless.

`register` imports ``vllm.config`` and wraps ``VllmConfig.__post_init__``; nothing else. With KVPP
off the wrapper only reads ``additional_config.enable_kvpp`` and calls vLLM's own ``__post_init__``:
no platform worker module is imported and no vLLM class or function changes. If even that wrapper
cannot be applied (a vLLM this plugin does not know), `register` logs it and returns.

With ``enable_kvpp`` on, the wrapper validates the configuration as given with the KVPP rules
(before vLLM's platform hooks, which on CPU quietly turn a requested FULL cudagraph mode into NONE) and
notes what the user chose (`setup.compile_modes.Requested`). After vLLM resolved it, it checks the platform,
release and model runner (`setup.validation.check_execution`), sets what the compilation mode needs
(`setup.compile_modes.configure_compilation`), applies the KVPP rules again (and checks an explicit
``kvpp_scratch_blocks``, `cache.scratch.check_explicit`), has vLLM's factory build KVPP's subclass of a KV
connector (`kv_connectors.routing.route_connector`), and points
``parallel_config.worker_cls`` at KVPP's subclass of the platform's worker (see `engine.worker`), so only the
worker processes of that engine are hooked.
"""

from __future__ import annotations

import functools
import logging

from kvpp_fx.integrations.vllm.setup.config import Deployment, KVPPConfig

logger = logging.getLogger(__name__)

_PATCHED = "_kvpp_fx_validation"


def validate_vllm_config(vllm_config) -> KVPPConfig:
    """Parse ``additional_config.enable_kvpp`` and apply the KVPP rules; raises `ValueError`."""
    config = KVPPConfig.from_vllm_config(vllm_config)
    if config.enabled:
        config.validate(Deployment.from_vllm_config(vllm_config))
    return config


def enable_kvpp(vllm_config, requested) -> KVPPConfig:
    """For a resolved config with KVPP on: check it runs, set what its compilation mode needs, then
    route its workers to the KVPP hooks. `requested`: `setup.compile_modes.Requested` of the config as given."""
    from kvpp_fx.integrations.vllm.setup.compile_modes import configure_compilation
    from kvpp_fx.integrations.vllm.cache.scratch import check_explicit
    from kvpp_fx.integrations.vllm.engine.state import hooked_worker_qualname
    from kvpp_fx.integrations.vllm.setup.validation import check_execution, deepseek_v4_model_type

    check_execution(vllm_config)
    if deepseek_v4_model_type(vllm_config.model_config) is None:
        # DeepSeek-V4's KVPP acts inside the attention's opaque op: vLLM compiles the rest as it would
        configure_compilation(vllm_config, requested, breakable=breakable_cudagraphs())
    config = validate_vllm_config(vllm_config)
    check_explicit(vllm_config, config)
    if getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector", None) is not None:
        from kvpp_fx.integrations.vllm.kv_connectors.routing import route_connector

        route_connector(vllm_config)
    parallel = vllm_config.parallel_config
    parallel.worker_cls = hooked_worker_qualname(str(parallel.worker_cls))
    logger.info("KVPP on: group size %d (TP %d x PCP %d); workers %s.", config.size, config.tp, config.pcp,
                parallel.worker_cls)
    return config


def breakable_cudagraphs() -> bool:
    """Whether vLLM captures breakable CUDA graphs, as vLLM resolved it (its config sets the variable for
    the architectures that default to them)."""
    import vllm.envs as envs

    return bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH)


def register() -> None:
    try:
        from vllm.config import VllmConfig

        original = VllmConfig.__post_init__
    except Exception as exc:  # noqa: BLE001 - a plugin must never stop vLLM from starting
        logger.warning("kvpp-fx: cannot hook vLLM's config (%s: %s); enable_kvpp will have no effect.",
                       type(exc).__name__, exc)
        return
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def post_init(self) -> None:
        enabled = validate_vllm_config(self).enabled
        if enabled:
            from kvpp_fx.integrations.vllm.setup.compile_modes import Requested

            requested = Requested.of(self)
        original(self)
        if enabled:
            enable_kvpp(self, requested)

    setattr(post_init, _PATCHED, True)
    VllmConfig.__post_init__ = post_init
