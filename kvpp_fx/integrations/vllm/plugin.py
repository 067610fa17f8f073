"""The ``vllm.general_plugins`` entry point. It runs in every vLLM process, so it stays harmless.

`register` imports ``vllm.config`` and wraps ``VllmConfig.__post_init__``; nothing else. With KVPP
off the wrapper only reads ``additional_config.enable_kvpp`` and calls vLLM's own ``__post_init__``:
no platform worker module is imported and no vLLM class or function changes. If even that wrapper
cannot be applied (a vLLM this plugin does not know), `register` logs it and returns.

With ``enable_kvpp`` on, the wrapper validates twice: the configuration as given (before vLLM's
platform hooks, which on CPU quietly turn a requested FULL cudagraph mode into NONE) with the KVPP
rules, and the resolved one with the KVPP rules plus `validation.check_execution`. Then it points
``parallel_config.worker_cls`` at KVPP's subclass of the platform's worker (see `worker`), so only the
worker processes of that engine are hooked.
"""

from __future__ import annotations

import functools
import logging

from kvpp_fx.config import Deployment, KVPPConfig

logger = logging.getLogger(__name__)

_PATCHED = "_kvpp_fx_validation"


def validate_vllm_config(vllm_config) -> KVPPConfig:
    """Parse ``additional_config.enable_kvpp`` and apply the KVPP rules; raises `ValueError`."""
    config = KVPPConfig.from_vllm_config(vllm_config)
    if config.enabled:
        config.validate(Deployment.from_vllm_config(vllm_config))
    return config


def enable_kvpp(vllm_config) -> KVPPConfig:
    """For a resolved config with KVPP on: check it runs, then route its workers to the KVPP hooks."""
    from kvpp_fx.integrations.vllm.state import hooked_worker_qualname
    from kvpp_fx.integrations.vllm.validation import check_execution

    config = validate_vllm_config(vllm_config)
    check_execution(vllm_config)
    parallel = vllm_config.parallel_config
    parallel.worker_cls = hooked_worker_qualname(str(parallel.worker_cls))
    logger.info("KVPP on: group size %d (TP %d x PCP %d); workers %s.", config.size, config.tp, config.pcp,
                parallel.worker_cls)
    return config


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
        requested = validate_vllm_config(self)
        if requested.enabled:
            from kvpp_fx.integrations.vllm.validation import check_requested

            check_requested(self)
        original(self)
        if requested.enabled:
            enable_kvpp(self)

    setattr(post_init, _PATCHED, True)
    VllmConfig.__post_init__ = post_init
