"""KVPP's subclass of vLLM's ExampleConnector (disk, one file per layer and prompt), for KVPP on a prefill
node (kv_role "kv_producer"): each layer is saved and loaded by its owner only (`base`)."""

from __future__ import annotations

import copy
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector as VllmExampleConnector,
)

from kvpp_fx.integrations.vllm.kv_connectors.base import KVPPConnector


class ExampleConnector(KVPPConnector, VllmExampleConnector):
    """vLLM's disk connector, one file per layer and prompt: each layer's file is written by its owner,
    from its persistent cache, and a prompt found on disk loads each layer into its owner only."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self.exposes(layer_name):
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if all(request.is_store for request in metadata.requests):  # nothing loads this step
            return super().start_load_kv(forward_context, **kwargs)
        owned = copy.copy(forward_context)
        owned.no_compile_layers = {name: layer for name, layer in forward_context.no_compile_layers.items()
                                   if getattr(layer, "kv_cache", None) is None or self.exposes(name)}
        super().start_load_kv(owned, **kwargs)
