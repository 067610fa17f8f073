"""The plugin's routing of a configured KV connector to KVPP's class of it, at ``LLM(...)``."""

from __future__ import annotations

import importlib
from typing import Any

from kvpp_fx.integrations.vllm.setup.config import KVPP_CONNECTOR_MODULE, KVPP_VLLM_CONNECTORS, MSG_NOT_KVPP_CONNECTOR


def route_connector(vllm_config: Any) -> None:
    """For an engine with KVPP on (validated): have vLLM's factory build KVPP's connector class. A
    connector of vLLM's named alone gets KVPP's connector module (`KVPP_CONNECTOR_MODULE`) as its module
    path; a module path the user set must name a KVPP connector, or `ValueError` says what to set."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    name = getattr(transfer, "kv_connector", None)
    if name is None:
        return
    module = transfer.kv_connector_module_path
    if module is None:
        if name in KVPP_VLLM_CONNECTORS:
            transfer.kv_connector_module_path = KVPP_CONNECTOR_MODULE
        return
    try:
        connector = getattr(importlib.import_module(module), name, None)
    except ImportError as exc:
        raise ValueError(MSG_NOT_KVPP_CONNECTOR.format(name=name, module=module) + f" ({exc})") from exc
    # Only where a module path names a class: vLLM's connector modules load only then.
    from kvpp_fx.integrations.vllm.kv_connectors.example import ExampleConnector
    from kvpp_fx.integrations.vllm.kv_connectors.mooncake import MooncakeConnector
    from kvpp_fx.integrations.vllm.kv_connectors.nixl import NixlConnector

    kvpp_connectors = (ExampleConnector, NixlConnector, MooncakeConnector)
    if not (isinstance(connector, type) and issubclass(connector, kvpp_connectors)):
        raise ValueError(MSG_NOT_KVPP_CONNECTOR.format(name=name, module=module))
