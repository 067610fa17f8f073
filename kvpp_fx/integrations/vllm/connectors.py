"""KVPP's subclasses of vLLM's KV connectors, for KVPP on a prefill node (kv_role "kv_producer").

Invariant: a rank hands a connector only the layers it keeps: the target layers it owns, and the draft
layers on the group's first rank. A non-owner's binding of a layer is a scratch slot, whose rows are
another step's copies, packed where the step's remapped block tables put them; no connector reads or
writes one. Every layer is still saved (and loaded) once, by its owner, so the other side of the
connector sees what it would from a replicated cache.

The plugin names this module in ``kv_transfer_config.kv_connector_module_path`` when KVPP is on and the
connector is one of `config.KVPP_VLLM_CONNECTORS`, so vLLM's connector factory builds the class here
that has vLLM's own name. Such a connector may also come from another module (a subclass of a class
here), which `route_connector` checks at ``LLM(...)``.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector as VllmExampleConnector,
)

from kvpp_fx.config import KVPP_CONNECTOR_MODULE, KVPP_VLLM_CONNECTORS, MSG_NOT_KVPP_CONNECTOR
from kvpp_fx.integrations.vllm.state import current_engine

class KVPPConnectorError(RuntimeError):
    """A connector was asked for a layer outside a KVPP step, where nothing says who owns it."""


class KVPPConnector:
    """What makes a vLLM connector KVPP's: it asks `exposes` before it touches a layer."""

    def exposes(self, layer_name: str) -> bool:
        """Whether this rank saves and loads `layer_name`: it owns the layer, or the layer is a draft
        layer (kept on every rank) and this is the group's first rank."""
        state = current_engine()
        if state is None or state.runtime is None or state.vplan is None:
            raise KVPPConnectorError(
                f"{type(self).__name__} was asked for layer {layer_name!r} outside a KVPP step of this "
                "worker: which rank owns it is not known there.")
        index = state.vplan.layer_index[layer_name]
        owner = state.plan.owner(index)
        return state.runtime.rank == (0 if owner is None else owner)


class ExampleConnector(KVPPConnector, VllmExampleConnector):
    """vLLM's disk connector, one file per layer and prompt: each layer's file is written by its owner,
    from its persistent cache, and a prompt found on disk loads each layer into its owner only."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self.exposes(layer_name):
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        owned = copy.copy(forward_context)
        owned.no_compile_layers = {name: layer for name, layer in forward_context.no_compile_layers.items()
                                   if getattr(layer, "kv_cache", None) is None or self.exposes(name)}
        super().start_load_kv(owned, **kwargs)


def route_connector(vllm_config: Any) -> None:
    """For an engine with KVPP on (validated): have vLLM's factory build KVPP's connector class. A
    connector of vLLM's named alone gets this module as its module path; a module path the user set
    must name a KVPP connector, or `ValueError` says what to set."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    name = getattr(transfer, "kv_connector", None)
    if name is None:
        return
    module = transfer.kv_connector_module_path
    if module is None:
        if name in KVPP_VLLM_CONNECTORS:
            transfer.kv_connector_module_path = KVPP_CONNECTOR_MODULE
        return
    connector = getattr(importlib.import_module(module), name, None)
    if not (isinstance(connector, type) and issubclass(connector, KVPPConnector)):
        raise ValueError(MSG_NOT_KVPP_CONNECTOR.format(name=name, module=module))
