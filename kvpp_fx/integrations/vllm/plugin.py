"""The ``vllm.general_plugins`` entry point: validate KVPP settings when vLLM builds its config.

`register` wraps ``VllmConfig.__post_init__``. The KVPP rules run twice: on the configuration as the
user gave it (before vLLM's platform hooks, which on CPU quietly turn a requested FULL cudagraph mode
into NONE), and on the resolved configuration (where GPU defaults may select a FULL mode). With KVPP
off, nothing else happens: the wrapper calls vLLM's own ``__post_init__`` unchanged.
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


def register() -> None:
    from vllm.config import VllmConfig

    from kvpp_fx.integrations.vllm import worker

    worker.install()

    original = VllmConfig.__post_init__
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def post_init(self) -> None:
        config = validate_vllm_config(self)  # as requested
        original(self)
        if config.enabled:
            validate_vllm_config(self)  # as resolved by vLLM and its platform
            logger.info("KVPP enabled: group size %d (TP %d x PCP %d).", config.size, config.tp, config.pcp)

    setattr(post_init, _PATCHED, True)
    VllmConfig.__post_init__ = post_init
