"""A deliberate connector fault, entering through the connector seam: a KVPP connector subclass, named
by ``kv_transfer_config.kv_connector_module_path`` (which the plugin accepts for KVPP connectors only).

The negative control of the PD test: with it a producer's files must differ from the replicated run's.
"""

from __future__ import annotations

from typing import Any

from kvpp_fx.integrations.vllm.kv_connectors import example, mooncake, nixl


class ExampleConnector(example.ExampleConnector):
    """Each rank saves the layers it does not own, and none that it owns, reading them once the forward
    is done (``wait_for_save``), as connectors that move KV asynchronously (NIXL, LMCache) read it: from
    scratch slots that later layers of the step have overwritten since."""

    def exposes(self, layer_name: str) -> bool:
        return not super().exposes(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self.exposes(layer_name):
            self.__dict__.setdefault("_deferred", []).append((layer_name, kv_layer, attn_metadata, kwargs))

    def wait_for_save(self) -> None:
        for layer_name, kv_layer, attn_metadata, kwargs in self.__dict__.pop("_deferred", []):
            example.VllmExampleConnector.save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs)


class NixlConnector(nixl.NixlConnector):
    """Rank 0 also exposes layer 3, which rank 1 owns (TP 2, 6 layers): its scratch slot for that layer,
    which holds layer 5's rows once the forward is done. The decode side reads a layer that two ranks
    expose from the rank it would read every layer from with KVPP off, rank 0."""

    def exposes(self, layer_name: str) -> bool:
        return super().exposes(layer_name) or layer_name == "model.layers.3.self_attn.attn"


class MooncakeConnector(mooncake.MooncakeConnector):
    """Rank 0 also exposes layer 3, which rank 1 owns (TP 2, 6 layers), and so registers its scratch slot
    for that layer with the transfer engine: a decode rank that asks rank 0 would be written its rows."""

    def exposes(self, layer_name: str) -> bool:
        return super().exposes(layer_name) or layer_name == "model.layers.3.self_attn.attn"
