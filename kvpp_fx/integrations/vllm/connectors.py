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
import dataclasses
import importlib
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector as VllmExampleConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as VllmNixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

from kvpp_fx.config import KVPP_CONNECTOR_MODULE, KVPP_VLLM_CONNECTORS, MSG_NOT_KVPP_CONNECTOR
from kvpp_fx.integrations.vllm.state import current_engine

class KVPPConnectorError(RuntimeError):
    """A connector was asked for a layer outside a KVPP step, where nothing says who owns it, or a
    remote instance's layers do not add up to this one's."""


class KVPPConnector:
    """What makes a vLLM connector KVPP's: it asks `exposes` before it hands a layer over."""

    def exposes(self, layer_name: str) -> bool:
        """Whether this rank saves, loads and exposes `layer_name`: it owns the layer, or the layer is a
        draft layer (kept on every rank) and this is the group's first rank."""
        return kept_here(type(self).__name__, layer_name)


def kept_here(connector: str, layer_name: str) -> bool:
    state = current_engine()
    if state is None or state.runtime is None or state.vplan is None:
        raise KVPPConnectorError(
            f"{connector} was asked for layer {layer_name!r} outside a KVPP step of this worker: which "
            "rank owns it is not known there.")
    owner = state.plan.owner(state.vplan.layer_index[layer_name])
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


class NixlConnector(KVPPConnector, VllmNixlConnector):
    """vLLM's NixlConnector (pull), for both ends of a pair whose prefill instance runs KVPP.

    On a KVPP rank (a prefill instance with KVPP on) the worker registers with NIXL only the layers the
    rank keeps, and its handshake metadata names them (vLLM's ``region_names``). On the reading side
    (KVPP off; named with ``kv_connector_module_path``) each rank handshakes with every rank of the remote
    instance and reads each layer from the remote rank that names it; a remote whose ranks each name
    every layer (KVPP off) is read as vLLM reads it.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.connector_scheduler = self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVPPNixlWorker(vllm_config, self.engine_id, kv_cache_config,
                                                   exposes=self.exposes)


class KVPPNixlWorker(NixlPullConnectorWorker):
    """`NixlConnector`'s worker: the producer side registers its own layers only; the reading side maps
    each of its regions (one per layer, MLA) to the remote rank that exposes that layer."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any, exposes: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._exposes = exposes
        # remote engine id -> the remote rank each local region (in `region_names` order) is read from
        self._region_sources: dict[str, list[int | None]] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if current_engine() is not None:  # KVPP on here: a non-owned layer is a scratch slot
            kv_caches = {name: cache for name, cache in kv_caches.items() if self._exposes(name)}
        super().register_kv_caches(kv_caches)
        topology = self.transfer_topo
        self.transfer_topo = AllRanksTopology(**{f.name: getattr(topology, f.name)
                                                  for f in dataclasses.fields(TransferTopology)})

    def add_remote_agent(self, nixl_agent_meta: Any, remote_tp_rank: int = 0, remote_tp_size: int = 1,
                         remote_dcp_size: int = 1) -> str:
        meta = nixl_agent_meta
        if (0, remote_tp_rank) in self._remote_agents.get(meta.engine_id, {}):
            return super().add_remote_agent(meta, remote_tp_rank, remote_tp_size, remote_dcp_size)
        names = list(meta.region_names or self.region_names)
        position = {name: i for i, name in enumerate(self.region_names)}
        unknown = [name for name in names if name not in position]
        if unknown or (len(names) < len(self.region_names) and not self.use_mla):
            raise KVPPConnectorError(
                f"rank {remote_tp_rank} of NIXL engine {meta.engine_id} exposes layers {names}, which this "
                f"instance cannot read by layer (its layers: {self.region_names}; MLA: {self.use_mla}).")
        sources = self._region_sources.setdefault(meta.engine_id, [None] * len(self.region_names))
        # Where several remote ranks expose a layer (every rank, with KVPP off), read it from the one
        # vLLM would read everything from.
        preferred = self.transfer_tp_rank * remote_tp_size // self.transfer_tp_size
        for name in names:
            if sources[position[name]] is None or remote_tp_rank == preferred:
                sources[position[name]] = remote_tp_rank
        if len(names) < len(self.region_names):
            meta = padded_to(meta, self.region_names)
        return super().add_remote_agent(meta, remote_tp_rank, remote_tp_size, remote_dcp_size)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        engine_id = meta.remote.engine_id
        sources = self._region_sources.get(engine_id)
        if (engine_id in self._invalid_remote_engines or engine_id not in self._remote_agents
                or sources is None or len(set(sources)) == 1
                or (self._bidirectional_kv_xfer_enabled and self._is_turn2_read_expired(meta))):
            return super()._read_blocks_for_req(req_id, meta)
        if None in sources:
            missing = [name for name, rank in zip(self.region_names, sources) if rank is None]
            raise KVPPConnectorError(f"no rank of NIXL engine {engine_id} exposes layers {missing}.")
        if self._mixed_mem_types or self.dcp_size > 1:
            raise KVPPConnectorError("reading layers from their owners needs one memory type and no DCP.")
        self._engine_last_active[engine_id] = time.perf_counter()
        remote_info = self.transfer_topo.get_engine_info(engine_id)
        local, remote = meta.local_physical_block_ids, []
        reads = any(len(group) > 0 for group in local)
        if reads:
            self._recving_transfers.setdefault(req_id, [])
            remote = self._logical_to_kernel_block_ids(meta.remote.block_ids,
                                                       remote_info.remote_physical_blocks_per_logical)
            local, remote = self._apply_prefix_caching(local, remote, self._physical_blocks_per_logical_kv_block,
                                                       remote_info.remote_physical_blocks_per_logical)
            local = self._block_ids_by_region(local, self.region_group_ids)
            remote = self._block_ids_by_region(remote, self.region_group_ids)
        # Every remote rank gets exactly one notification from each local rank: its read's, or a bare one.
        for _, rank in sorted(self._remote_agents[engine_id]):
            def own(by_region: list) -> list:
                return [list(ids) if sources[i] == rank else [] for i, ids in enumerate(by_region)]

            spec = (ReadSpec(rank, own(local), own(remote), block_ids_by_region=True) if reads
                    else ReadSpec(rank, [], []))
            if not self._read_blocks(
                    read_spec=spec, dst_engine_id=engine_id, request_id=req_id,
                    remote_request_id=meta.remote.request_id,
                    local_xfer_side_handle=self.src_xfer_handles_by_block_size[remote_info.remote_block_size],
                    local_dram_handle=None, remote_xfer_side_handle=self.dst_xfer_side_handles[engine_id][rank],
                    expected_consumers=self.transfer_tp_size, awaiting_kvs=meta.awaiting_kvs):
                return


NixlPullConnector = NixlConnector


class AllRanksTopology(TransferTopology):
    """vLLM's transfer topology, but handshaking with every remote rank: any of them may own a layer."""

    def handshake_target_ranks(self, remote_tp_size: int, remote_dcp_size: int = 1) -> list[int]:
        if remote_dcp_size > 1:
            return super().handshake_target_ranks(remote_tp_size, remote_dcp_size)
        return list(range(remote_tp_size))


def padded_to(meta: Any, region_names: list[str]) -> Any:
    """A remote rank's handshake metadata over a subset of the layers, as if it had all `region_names`:
    a layer it does not expose repeats its first region, which the reads never address."""
    position = {name: k for k, name in enumerate(meta.region_names)}
    rows = [position.get(name, 0) for name in region_names]

    def pad(values: Any) -> Any:
        return None if values is None else [values[k] for k in rows]

    return dataclasses.replace(
        meta, kv_caches_base_addr=pad(meta.kv_caches_base_addr), block_lens=pad(meta.block_lens),
        block_strides=pad(meta.block_strides), region_num_blocks=pad(meta.region_num_blocks),
        region_group_ids=pad(meta.region_group_ids), region_mem_types=pad(meta.region_mem_types),
        region_members=[[name] for name in region_names] if meta.region_members else [],
        region_names=list(region_names))
