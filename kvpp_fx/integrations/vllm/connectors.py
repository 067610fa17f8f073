"""KVPP's KV connector classes under vLLM's names, for vLLM's connector factory: the module that
``kv_transfer_config.kv_connector_module_path`` names (`setup.config.KVPP_CONNECTOR_MODULE`; the plugin
sets it, and a decode instance names it by hand). It only names the classes: each is defined in
`kv_connectors`, and a user's KVPP connector subclasses one of them. `MooncakeConnector` is imported when
first asked for: vLLM's Mooncake module warns in every process of a deployment without the ``mooncake``
package, which an Example or NIXL deployment need not have."""

from typing import Any

from kvpp_fx.integrations.vllm.kv_connectors.example import ExampleConnector
from kvpp_fx.integrations.vllm.kv_connectors.nixl import NixlConnector, NixlPullConnector

__all__ = ["ExampleConnector", "MooncakeConnector", "NixlConnector", "NixlPullConnector"]


def __getattr__(name: str) -> Any:
    if name == "MooncakeConnector":
        from kvpp_fx.integrations.vllm.kv_connectors.mooncake import MooncakeConnector

        return MooncakeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
