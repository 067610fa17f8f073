"""KVPP's subclass of vLLM's MooncakeConnector, for both ends of a pair whose prefill instance runs KVPP
(``kvpp_fx.integrations.vllm.connectors`` names it under vLLM's name, for vLLM's connector factory).

Invariant: as in `base`, a KVPP rank hands the transfer engine only the layers it keeps, and every
layer reaches a decode rank once, from its owner; a decode rank that would miss some is refused by name.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as vllm_mooncake

from kvpp_fx.integrations.vllm.setup.config import KVPP_CONNECTOR_MODULE
from kvpp_fx.integrations.vllm.kv_connectors.base import (AllRanksTopology, KVPPConnector, KVPPConnectorError,
                                                          owner_rank, retyped_topology)


class MooncakeConnector(KVPPConnector, vllm_mooncake.MooncakeConnector):
    """vLLM's MooncakeConnector (a decode rank asks prefill ranks for a request's blocks, and they write
    them into its cache), for both ends of a pair whose prefill instance runs KVPP.

    On a KVPP rank (`KVPPMooncakeWorker`) only the layers the rank keeps are registered and written, and
    the instance's bootstrap server also says which rank owns each layer. The decode instance (KVPP off)
    runs vLLM's own connector where each of its ranks asks every prefill rank (vLLM's MLA pairing does so
    for a TP 1 decode instance), or this class, named with ``kv_connector_module_path``
    (`KVPPMooncakeReader`), which asks every rank of a KVPP prefill instance at any TP.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

        # vLLM's MooncakeConnector.__init__ would build its own worker (and transfer engine) first.
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.connector_scheduler = self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = vllm_mooncake.MooncakeConnectorScheduler(vllm_config, self.engine_id,
                                                                                kv_cache_config)
        elif role == KVConnectorRole.WORKER and self._kvpp_on:
            self.connector_worker = KVPPMooncakeWorker(vllm_config, self.engine_id, kv_cache_config, self.exposes)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVPPMooncakeReader(vllm_config, self.engine_id, kv_cache_config)


# The route a KVPP prefill instance's Mooncake bootstrap server adds: layer name -> owning TP rank.
MOONCAKE_OWNERS_ROUTE = "/kvpp/owners"


class EveryRankXferMetadata(vllm_mooncake.MooncakeXferMetadata, omit_defaults=True):
    """vLLM's request for a request's blocks, saying whether the decode rank asks every prefill rank (a
    `KVPPMooncakeReader`); vLLM's own prefill ranks ignore the field."""

    asks_every_rank: bool = False


class KVPPMooncakeWorker(vllm_mooncake.MooncakeConnectorWorker):
    """`MooncakeConnector`'s worker on a KVPP rank.

    Invariants:
    - Only the layers `exposes` keeps are registered with the transfer engine; a rank that keeps none
      raises `KVPPConnectorError`.
    - Every rank writes its registered layers to each decode rank that asks, and expects every decode
      rank to ask it (vLLM writes a replicated MLA cache from one rank of the ones a decode rank pairs
      with).
    - A decode rank is served only where it asks every rank of this instance: vLLM's connector where its
      pairing does, or a `KVPPMooncakeReader`. Otherwise the reply is an error that says what to run.
    - Before any write, every layer registered here is one the plan says this rank owns: a scratch slot
      never leaves (the reply is a `KVPPConnectorError`).
    """

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any,
                 exposes: Callable[[str], bool]) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._exposes = exposes
        self._owned: frozenset[str] = frozenset()
        self._xfer_meta_decoder = msgspec.msgpack.Decoder(EveryRankXferMetadata)
        self.transfer_topo = retyped_topology(self.transfer_topo, AllRanksTopology)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        kept = {name: cache for name, cache in kv_caches.items() if self._exposes(name)}
        if not kept:
            raise KVPPConnectorError("this KVPP rank keeps no layer to register with Mooncake (more ranks than "
                                     "layers).")
        # Read here, on the worker's thread, where the engine's plan is current; the sender threads check it.
        owners = {name: owner_rank(type(self).__name__, name) for name in kv_caches}
        self._owned = frozenset(name for name, rank in owners.items() if rank == self.tp_rank)
        server = getattr(self, "bootstrap_server", None)
        if server is not None:
            server.app.get(MOONCAKE_OWNERS_ROUTE)(lambda: owners)
        super().register_kv_caches(kept)

    def _get_sender_transfer_plan(self, local_kv_block_len: int, remote_kv_block_len: int, remote_tp_rank: int,
                                  remote_tp_size: int) -> tuple[bool, int, int, int]:
        _, remote_offset, local_offset, length = super()._get_sender_transfer_plan(
            local_kv_block_len, remote_kv_block_len, remote_tp_rank, remote_tp_size)
        return True, remote_offset, local_offset, length

    def _prepare_transfer_regions(self, meta: Any) -> tuple[list, list, str | None]:
        missed = [] if meta.asks_every_rank else ranks_not_asked(self.tp_size, meta.remote_tp_rank,
                                                                  meta.remote_tp_size)
        if missed:
            return [], [], (
                f"{KVPPConnectorError.__name__}: decode rank {meta.remote_tp_rank} (TP {meta.remote_tp_size}) "
                f"asks only some ranks of this KVPP prefill instance (TP {self.tp_size}) for a request's KV; "
                f"it would miss the layers that ranks {missed} own. Name kv_connector_module_path="
                f"{KVPP_CONNECTOR_MODULE!r} on the decode instance, or run it with TP 1.")
        # The registered names, not the regions: vLLM's coalescing names a span of layers by its first.
        foreign = sorted(set(self.registered_layer_names) - self._owned)
        if foreign:
            return [], [], (
                f"{KVPPConnectorError.__name__}: prefill rank {self.tp_rank} was about to send layers {foreign}, "
                "which it does not own: its binding of them is a scratch slot.")
        return super()._prepare_transfer_regions(meta)


def ranks_not_asked(prefill_tp_size: int, decode_rank: int, decode_tp_size: int) -> list[int]:
    """The ranks of an MLA prefill instance that vLLM's MooncakeConnector on a decode rank does not ask
    for a request's KV (vLLM's pairing: `TransferTopology.handshake_target_ranks`)."""
    decode_side = TransferTopology(tp_rank=decode_rank, tp_size=decode_tp_size, block_size=1, engine_id="decode",
                                   is_mla=True, is_mamba=False, total_num_kv_heads=1, attn_backends=[])
    asked = set(decode_side.handshake_target_ranks(prefill_tp_size))
    return [rank for rank in range(prefill_tp_size) if rank not in asked]


class KVPPMooncakeReader(vllm_mooncake.MooncakeConnectorWorker):
    """`MooncakeConnector`'s worker on a decode instance (KVPP off), named by module path.

    Invariants:
    - A prefill instance is partitioned where its bootstrap server answers `MOONCAKE_OWNERS_ROUTE` (a KVPP
      instance), replicated otherwise; asked before vLLM's own query, so no request reaches a prefill
      instance before it is classified.
    - A request from a replicated instance is vLLM's. One from a partitioned instance is asked of every
      prefill rank, marked so (`EveryRankXferMetadata`), and each rank writes the layers it owns; an owner
      map that does not name a rank of the instance for every layer here fails the request by name first.
    """

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._owners: dict[str, dict[str, int] | None] = {}  # bootstrap address -> layer owners, or None
        self.transfer_topo = retyped_topology(self.transfer_topo, _ReaderTopology)
        self._encoder = _EveryRankEncoder(self._encoder)

    async def _connect_to_prefiller_bootstrap(self, remote_bootstrap_addr: str) -> None:
        self._owners[remote_bootstrap_addr] = await self._query_owners(remote_bootstrap_addr)
        await super()._connect_to_prefiller_bootstrap(remote_bootstrap_addr)

    async def _query_owners(self, remote_bootstrap_addr: str) -> dict[str, int] | None:
        timeout = vllm_mooncake.envs.VLLM_MOONCAKE_CONNECTOR_TIMEOUT
        try:
            async with vllm_mooncake.httpx.AsyncClient(timeout=timeout) as client:
                response = await client.get(remote_bootstrap_addr + MOONCAKE_OWNERS_ROUTE)
            if response.status_code != 200:  # vLLM's own prefill instance: replicated
                return None
            return {str(name): int(rank) for name, rank in response.json().items()}
        except Exception:  # unreachable or garbled: read as vLLM reads it; vLLM's own query reports the former
            return None

    def receive_kv(self, remote_engine_id: str, pull_metas: dict) -> None:
        address = next(iter(pull_metas.values())).remote_bootstrap_addr
        owners = self._owners.get(address)
        if owners is None:
            return super().receive_kv(remote_engine_id, pull_metas)
        remote_tp_size = self._tp_size[remote_engine_id]
        unowned = sorted(name for name in self.registered_layer_names
                         if not 0 <= owners.get(name, -1) < remote_tp_size)
        if unowned:
            self._handle_failed_recv(pull_metas, list(pull_metas), (
                f"{KVPPConnectorError.__name__}: KVPP prefill instance {remote_engine_id} (TP {remote_tp_size}) names "
                f"no owner among its ranks for layers {unowned} of this instance."))
            return
        # vLLM's receive_kv picks the ranks here (`_ReaderTopology`) and makes one task per rank, each of
        # which carries the flag to its request's metadata (`_EveryRankEncoder`).
        token = _ASKS_EVERY_RANK.set(True)
        try:
            super().receive_kv(remote_engine_id, pull_metas)
        finally:
            _ASKS_EVERY_RANK.reset(token)


_ASKS_EVERY_RANK: contextvars.ContextVar[bool] = contextvars.ContextVar("kvpp_mooncake_asks_every_rank",
                                                                       default=False)


class _ReaderTopology(TransferTopology):
    """vLLM's transfer topology on a `KVPPMooncakeReader`: every remote rank while a request is asked of
    every rank."""

    def handshake_target_ranks(self, remote_tp_size: int, remote_dcp_size: int = 1) -> list[int]:
        if _ASKS_EVERY_RANK.get() and remote_dcp_size == 1:
            return list(range(remote_tp_size))
        return super().handshake_target_ranks(remote_tp_size, remote_dcp_size)


class _EveryRankEncoder:
    """vLLM's encoder on a `KVPPMooncakeReader`: a request for blocks asked of every prefill rank goes out
    as `EveryRankXferMetadata`."""

    def __init__(self, encoder: Any) -> None:
        self._encoder = encoder

    def encode(self, obj: Any) -> bytes:
        if isinstance(obj, vllm_mooncake.MooncakeXferMetadata) and _ASKS_EVERY_RANK.get():
            obj = EveryRankXferMetadata(**{f: getattr(obj, f) for f in obj.__struct_fields__}, asks_every_rank=True)
        return self._encoder.encode(obj)
