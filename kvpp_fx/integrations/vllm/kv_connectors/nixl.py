"""KVPP's subclass of vLLM's NixlConnector (pull), for both ends of a pair whose prefill instance runs
KVPP: a KVPP rank registers and names only the layers it keeps (`base`); a reader reads each layer from
the remote rank that names it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as VllmNixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

from kvpp_fx.integrations.vllm.kv_connectors.base import (AllRanksTopology, KVPPConnector, KVPPConnectorError,
                                                          retyped_topology)
from kvpp_fx.integrations.vllm.setup.config import KVPP_CONNECTOR_MODULE


class NixlConnector(KVPPConnector, VllmNixlConnector):
    """vLLM's NixlConnector (pull), for both ends of a pair whose prefill instance runs KVPP.

    On a KVPP rank (a prefill instance with KVPP on) the worker registers with NIXL only the layers the
    rank keeps, and its handshake metadata names them (vLLM's ``region_names``). On the reading side
    (KVPP off; named with ``kv_connector_module_path``) each rank handshakes with every rank of the remote
    instance and reads each layer from the remote rank that names it (`KVPPNixlWorker`).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

        # vLLM's NixlPullConnector.__init__ would build its own worker (and NIXL agent) first.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.connector_scheduler = self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVPPNixlWorker(vllm_config, self.engine_id, kv_cache_config,
                                                   exposes=self.exposes, partitioned=self._kvpp_on)


NixlPullConnector = NixlConnector


class KVPPNixlWorker(NixlPullConnectorWorker):
    """`NixlConnector`'s worker.

    Invariants:
    - On a KVPP rank only the layers `exposes` keeps are registered and named; a rank that keeps none
      raises `KVPPConnectorError`.
    - A reader (MLA, no DCP) classifies each remote instance once its handshake is done: replicated (every
      rank names every layer: each layer is read from the rank vLLM reads everything from) or partitioned
      (each layer named by exactly one rank: read from it). Anything else, or a layout that differs from
      this instance's, raises `KVPPConnectorError` before any read, on the engine's thread.
    - Every remote rank gets exactly one notification per request from each reading rank (its read's,
      or a bare one), so it frees the request's blocks after ``transfer_tp_size`` of them.
    """

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any,
                 exposes: Callable[[str], bool], partitioned: bool = False) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._exposes = exposes
        self._partitioned = partitioned
        self._by_layer = self.use_mla and self.dcp_size == 1
        # remote engine id -> the remote rank each local region (in `region_names` order) is read from
        self._region_sources: dict[str, list[int]] = {}
        # remote engine id -> per remote rank, the layers it names (filled during the handshake)
        self._named: dict[str, dict[int, list[str]]] = {}
        self._layout_errors: dict[str, KVPPConnectorError] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        kept = {name: cache for name, cache in kv_caches.items() if self._exposes(name)}
        if not kept:
            raise KVPPConnectorError("this KVPP rank keeps no layer to register with NIXL (more ranks than layers).")
        super().register_kv_caches(kept)
        if self._partitioned:
            # vLLM's own reader compares the hash before anything else and shows it in its error.
            self.xfer_handshake_metadata = dataclasses.replace(
                self.xfer_handshake_metadata, compatibility_hash=self.compat_hash + NIXL_PARTITIONED_HASH_SUFFIX)
        else:
            self.compat_hash = _AcceptsPartitionedHash(self.compat_hash)
        if self._by_layer:
            self.transfer_topo = retyped_topology(self.transfer_topo, AllRanksTopology)

    def _nixl_handshake(self, host: str, port: int, remote_tp_size: int, expected_engine_id: str,
                        *args: Any, **kwargs: Any) -> Any:
        self._named[expected_engine_id] = {}
        self._region_sources.pop(expected_engine_id, None)
        self._layout_errors.pop(expected_engine_id, None)
        result = super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs)
        if self._by_layer and self._named[expected_engine_id]:
            try:
                self._region_sources[expected_engine_id] = self._sources(expected_engine_id, remote_tp_size)
            except KVPPConnectorError as exc:  # raised where the engine reads, not in the handshake thread
                self._layout_errors[expected_engine_id] = exc
        return result

    def add_remote_agent(self, nixl_agent_meta: Any, remote_tp_rank: int = 0, remote_tp_size: int = 1,
                         remote_dcp_size: int = 1) -> str:
        meta = nixl_agent_meta
        if not self._by_layer or (0, remote_tp_rank) in self._remote_agents.get(meta.engine_id, {}):
            return super().add_remote_agent(meta, remote_tp_rank, remote_tp_size, remote_dcp_size)
        names = list(self.region_names if meta.region_names is None else meta.region_names)
        unknown = sorted(set(names) - set(self.region_names))
        if unknown or not names:
            raise KVPPConnectorError(
                f"rank {remote_tp_rank} of NIXL engine {meta.engine_id} names layers {names}; this instance "
                f"has {self.region_names}.")
        self._named.setdefault(meta.engine_id, {})[remote_tp_rank] = names
        if len(names) < len(self.region_names):
            meta = padded_to(meta, self.region_names)
        return super().add_remote_agent(meta, remote_tp_rank, remote_tp_size, remote_dcp_size)

    def _sources(self, engine_id: str, remote_tp_size: int) -> list[int]:
        named = self._named[engine_id]
        if sorted(named) != list(range(remote_tp_size)):
            raise KVPPConnectorError(f"NIXL engine {engine_id}: handshakes with ranks {sorted(named)} of "
                                     f"{remote_tp_size}.")
        if all(set(names) == set(self.region_names) for names in named.values()):  # replicated
            preferred = self.transfer_tp_rank * remote_tp_size // self.transfer_tp_size
            return [preferred] * len(self.region_names)
        by_layer: dict[str, list[int]] = {name: [] for name in self.region_names}
        for rank, names in named.items():
            for name in names:
                by_layer[name].append(rank)
        wrong = {name: ranks for name, ranks in by_layer.items() if len(ranks) != 1}
        if wrong:
            raise KVPPConnectorError(
                f"NIXL engine {engine_id} is neither replicated nor partitioned by layer: these layers are named "
                f"by other than exactly one rank: {wrong}. A KVPP prefill rank must name only the layers it owns.")
        return [by_layer[name][0] for name in self.region_names]

    def _cleanup_remote_engine(self, engine_id: str, *args: Any, **kwargs: Any) -> None:
        super()._cleanup_remote_engine(engine_id, *args, **kwargs)
        self._region_sources.pop(engine_id, None)
        self._named.pop(engine_id, None)
        self._layout_errors.pop(engine_id, None)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        engine_id = meta.remote.engine_id
        if (not self._by_layer or engine_id in self._invalid_remote_engines or engine_id not in self._remote_agents
                or (self._bidirectional_kv_xfer_enabled and self._is_turn2_read_expired(meta))):
            return super()._read_blocks_for_req(req_id, meta)  # vLLM's handling: failures, handshakes, expiry
        sources = self._region_sources.get(engine_id)
        remote_info = self.transfer_topo.get_engine_info(engine_id)
        self._check_layout(engine_id, sources, remote_info)
        self._engine_last_active[engine_id] = time.perf_counter()
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
        local_handle = self.src_xfer_handles_by_block_size[remote_info.remote_block_size]
        for _, rank in sorted(self._remote_agents[engine_id]):
            spec = (ReadSpec(rank, _of_rank(local, sources, rank), _of_rank(remote, sources, rank),
                             block_ids_by_region=True) if reads else ReadSpec(rank, [], []))
            if not self._read_blocks(
                    read_spec=spec, dst_engine_id=engine_id, request_id=req_id,
                    remote_request_id=meta.remote.request_id, local_xfer_side_handle=local_handle,
                    local_dram_handle=None, remote_xfer_side_handle=self.dst_xfer_side_handles[engine_id][rank],
                    expected_consumers=self.transfer_tp_size, awaiting_kvs=meta.awaiting_kvs):
                return

    def _check_layout(self, engine_id: str, sources: list[int] | None, remote_info: Any) -> None:
        """Refuse, before any read, what reading by layer does not handle."""
        if engine_id in self._layout_errors:
            raise self._layout_errors[engine_id]
        why = None
        if sources is None:
            why = "its ranks' layers were not recorded at the handshake"
        elif self._mixed_mem_types:
            why = "this instance mixes memory types"
        elif remote_info.remote_block_size != self.block_size:
            why = f"its block size {remote_info.remote_block_size} differs from {self.block_size}"
        elif remote_info.remote_physical_blocks_per_logical != self._physical_blocks_per_logical_kv_block:
            why = "its physical blocks per logical block differ from this instance's"
        elif self.dst_region_group_ids.get(engine_id) != self.region_group_ids:
            why = "its layers' cache groups differ from this instance's"
        if why is not None:
            raise KVPPConnectorError(f"cannot read NIXL engine {engine_id} layer by layer: {why}.")


# What a KVPP prefill rank appends to the NIXL compatibility hash it publishes: vLLM's own reader then
# refuses the handshake with an error that shows it.
NIXL_PARTITIONED_HASH_SUFFIX = (
    " (a KVPP prefill instance: each rank exposes only the layers it owns; read it with "
    f"kv_connector_module_path={KVPP_CONNECTOR_MODULE!r} on the decode instance)")


class _AcceptsPartitionedHash(str):
    """A reader's compatibility hash, which vLLM compares with ``remote != local``: also equal to the hash a
    KVPP prefill rank publishes (Python tries a subclass's reflected ``__ne__`` first)."""

    def _accepts(self, other: object) -> bool:
        return other in (str(self), str(self) + NIXL_PARTITIONED_HASH_SUFFIX)

    def __eq__(self, other: object) -> bool:
        return self._accepts(other)

    def __ne__(self, other: object) -> bool:
        return not self._accepts(other)

    __hash__ = str.__hash__


def _of_rank(by_region: list, sources: list[int], rank: int) -> list:
    """The block ids of the regions read from `rank`; empty for the others."""
    return [list(ids) if sources[i] == rank else [] for i, ids in enumerate(by_region)]


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
