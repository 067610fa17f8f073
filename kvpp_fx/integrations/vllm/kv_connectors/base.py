"""What every KVPP connector shares: the rule that a rank hands a connector only the layers it keeps, the
owner of a layer read from the engine, and vLLM's transfer topology retyped to a subclass that changes
which remote ranks a rank handshakes with.

Invariant: a rank hands a connector only the layers it keeps: the target layers it owns, and the draft
layers on the group's first rank. A non-owner's binding of a layer is a scratch slot, whose rows are
another step's copies, packed where the step's remapped block tables put them; no connector reads or
writes one. Every layer is still saved (and loaded) once, by its owner, so the other side of the
connector sees what it would from a replicated cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology

from kvpp_fx.integrations.vllm.engine.state import current_engine
from kvpp_fx.integrations.vllm.setup.config import KVPPConfig

Topology = TypeVar("Topology", bound=TransferTopology)


class KVPPConnectorError(RuntimeError):
    """A KVPP rank's connector was asked for a layer where nothing says who owns it, or a remote
    instance's layers cannot be read layer by layer from their owners."""


class KVPPConnector:
    """What makes a vLLM connector KVPP's: on a KVPP rank it asks `exposes` before it hands a layer over."""

    _vllm_config: Any  # set by vLLM's KVConnectorBase_V1

    @functools.cached_property
    def _kvpp_on(self) -> bool:
        return KVPPConfig.from_vllm_config(self._vllm_config).enabled

    def exposes(self, layer_name: str) -> bool:
        """Whether this rank saves, loads and exposes `layer_name`: with KVPP off every layer; with it on
        a layer it owns, or a draft layer (kept on every rank) on the group's first rank."""
        return not self._kvpp_on or kept_here(type(self).__name__, layer_name)


def kept_here(connector: str, layer_name: str) -> bool:
    """Whether this KVPP rank keeps `layer_name`, read from the engine the worker is running; raises
    `KVPPConnectorError` where no engine is current or the plan does not hold the layer."""
    owner = owner_rank(connector, layer_name)
    return current_engine().comm.runtime.rank == owner


def owner_rank(connector: str, layer_name: str) -> int:
    """The TP rank that keeps `layer_name` (a draft layer: the group's first), read from the engine the
    worker is running; raises `KVPPConnectorError` where no engine is current or the plan does not hold
    the layer."""
    state = current_engine()
    if state is None or state.comm.runtime is None or state.vplan is None:
        raise KVPPConnectorError(
            f"{connector} was asked for layer {layer_name!r} outside a KVPP step of this worker: which "
            "rank owns it is not known there.")
    if layer_name not in state.vplan.layer_index:
        raise KVPPConnectorError(f"{connector} was asked for layer {layer_name!r}, which KVPP's plan does not hold.")
    owner = state.plan.owner(state.vplan.layer_index[layer_name])
    return 0 if owner is None else owner


def retyped_topology(topology: TransferTopology, cls: type[Topology]) -> Topology:
    """vLLM's transfer topology `topology` as an instance of its subclass `cls`, with the same values of
    every field vLLM's `TransferTopology` declares."""
    if not issubclass(cls, TransferTopology):
        raise TypeError(f"{cls.__qualname__} is not a subclass of vLLM's TransferTopology.")
    return cls(**{f.name: getattr(topology, f.name) for f in dataclasses.fields(TransferTopology)})


class AllRanksTopology(TransferTopology):
    """vLLM's transfer topology, but handshaking with every remote rank: any of them may own a layer."""

    def handshake_target_ranks(self, remote_tp_size: int, remote_dcp_size: int = 1) -> list[int]:
        if remote_dcp_size > 1:
            return super().handshake_target_ranks(remote_tp_size, remote_dcp_size)
        return list(range(remote_tp_size))
