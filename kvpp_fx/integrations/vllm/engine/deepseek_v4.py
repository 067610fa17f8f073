"""KVPP for DeepSeek-V4 inside a vLLM worker: one owner per target layer, every row on its owner.

A DeepSeek-V4 engine takes its own path through the KVPP worker (`worker`), in the order vLLM calls it:

1. ``init_device``: the target layers, from the model's config.
2. ``load_model``: every target layer's attention routed through its owner (`attention.deepseek_v4`).
3. ``determine_available_memory``: the KVPP groups, made and used once before vLLM measures (`connect`);
   then, from vLLM's KV cache groups, one owner per target layer (`kvpp_fx.cache.layer_caches`'s
   `balanced_group_owners`: the largest rank's block as small as it gets; MTP layers on every rank) and the
   budget of the rank's own pages (`cache.deepseek_v4.budget`).
4. ``initialize_from_config``: vLLM allocates only the held layers' pages, re-laid out
   (`cache.deepseek_v4.allocate`); every layer's attention sinks are gathered for its owner.
5. Each forward: each target layer's attention exchanges its queries and outputs with the layer's owner.

The model runner stays vLLM's (V1 or V2, any compile mode): nothing KVPP does for DeepSeek-V4 happens
outside the attention's own call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvpp_fx.integrations.vllm.attention import deepseek_v4 as attention
from kvpp_fx.integrations.vllm.cache import deepseek_v4 as cache
from kvpp_fx.integrations.vllm.engine.state import KVPPAllocationError
from kvpp_fx.passes.registry import LAYER_NAME_PATTERN
from kvpp_fx.runtime.collectives import Collectives
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.health import Health
from kvpp_fx.runtime.parts import collective_timeout
from kvpp_fx.runtime.stats import TransferStats

logger = logging.getLogger(__name__)

MODEL_TYPES = ("deepseek_v4",)


def is_deepseek_v4(vllm_config: Any) -> bool:
    return getattr(vllm_config.model_config.hf_text_config, "model_type", None) in MODEL_TYPES


class DeepseekV4Engine:
    """One worker's KVPP state for a DeepSeek-V4 model, its methods in the order the worker calls them."""

    def __init__(self, config: Any, vllm_config: Any) -> None:
        self.config = config
        self.num_target_layers = int(vllm_config.model_config.hf_text_config.num_hidden_layers)
        self.target_layers = tuple(range(self.num_target_layers))
        self.owners: dict[int, int] | None = None  # from vLLM's KV cache groups, at the budget
        self.hooks: dict[int, attention.OwnerRoutedAttention] = {}
        self.group = self.agreement_group = self.exchange_group = None
        self.rank, self.group_size = 0, config.size
        self.api: DeviceAPI | None = None
        self.health = Health(0)
        self.collectives: Collectives | None = None
        self.timeout = None
        self.stats = TransferStats(self.target_layers)
        self.budget_blocks: int | None = None
        self.packed_stride = self.rank_stride = 0
        self.pages: dict[str, int] = {}
        self.allocation: dict[str, Any] = {}

    # --- the plan -----------------------------------------------------------------------------------

    def layer_of(self, name: str) -> int | None:
        """The target layer a module or cache layer name belongs to; None for an MTP layer's."""
        match = LAYER_NAME_PATTERN.search(name)
        if match is None:
            raise KVPPAllocationError(f"cannot read a layer index from vLLM layer name {name!r}.")
        index = int(match.group(1))
        return index if index < self.num_target_layers else None

    def owner(self, layer: int) -> int:
        if self.owners is None:
            raise KVPPAllocationError(f"layer {layer}'s owner is chosen with the KV cache budget, which vLLM has "
                                      "not asked for yet.")
        return self.owners[layer]

    def owned_layers(self) -> list[int]:
        return [layer for layer in self.target_layers if self.owners and self.owners[layer] == self.rank]

    def holds(self, name: str) -> bool:
        """Whether this rank keeps the cache layer `name`: its own layers' and every MTP layer's."""
        layer = self.layer_of(name)
        return layer is None or self.owner(layer) == self.rank

    def position(self, layer: int) -> int:
        return self.target_layers.index(layer)

    # --- load_model --------------------------------------------------------------------------------

    def hook_model(self, model: Any) -> None:
        self.hooks = attention.hook_model(model, self)

    # --- determine_available_memory ----------------------------------------------------------------

    def connect(self, device: Any) -> None:
        """The KVPP group and its exchange group, each collective owner mode issues run once (module
        docstring of `allocation.connect`: their buffers then sit inside vLLM's measurement)."""
        if self.group is not None:
            return
        import torch.distributed as dist

        from kvpp_fx.integrations.vllm.cache.allocation import kvpp_group

        self.group, self.agreement_group, self.exchange_group, ranks = kvpp_group(self.config, exchanges=True)
        self.rank, self.group_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.api = DeviceAPI(torch.device(device))
        if not self.api.immediate_checks:  # an owner's failure status would be left unread
            raise KVPPAllocationError(f"KVPP runs DeepSeek-V4 on CPU only, not on {self.api.device.type}.")
        self.timeout = collective_timeout(None, self.exchange_group, self.api.device)
        self.health = Health(self.rank)
        self.collectives = Collectives(self.api, self.timeout, self.health)
        one = torch.zeros(1, device=device)
        for owner in range(self.group_size):
            parts = [torch.zeros_like(one) for _ in range(self.group_size)] if owner == self.rank else None
            dist.gather(one, parts, dst=self.global_rank(owner), group=self.exchange_group)
            dist.scatter(one, parts, src=self.global_rank(owner), group=self.exchange_group)

    def set_device_api(self, factory: str | None) -> None:
        """The exchanges of the following forwards through the `DeviceAPI` that `factory` names (None: the
        default), with a new health: the tests' seam for faults."""
        from kvpp_fx.runtime.device import resolve_device_api

        if self.api is None:
            raise KVPPAllocationError("kvpp_set_device_api before KVPP made its groups.")
        device = self.api.device
        self.api = DeviceAPI(device) if factory is None else resolve_device_api(factory, device)
        self.health = Health(self.rank)
        self.collectives = Collectives(self.api, self.timeout, self.health)

    def global_rank(self, rank: int) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.exchange_group, rank)

    def budget(self, runner: Any, available: int) -> int:
        return cache.budget(self, runner.vllm_config, runner.get_kv_cache_spec(), available)

    def note_budget(self, owners: dict[int, int], blocks: int, packed_stride: int, rank_stride: int,
                    pages: dict[str, int]) -> None:
        self.owners = owners
        self.budget_blocks, self.packed_stride, self.rank_stride, self.pages = blocks, packed_stride, rank_stride, pages
        logger.warning("KVPP: DeepSeek-V4 rank %d owns layers %s of %d; blocks of %d bytes here (vLLM packs %d): "
                       "%d blocks.", self.rank, self.owned_layers(), len(self.target_layers), rank_stride,
                       packed_stride, blocks)

    # --- initialize_from_config ---------------------------------------------------------------------

    def allocate(self, kv_cache_config: Any, vllm_allocate: Any) -> dict[str, torch.Tensor]:
        """This rank's caches, then every layer's sinks; a rank whose allocation fails (KVPP's refusal of its
        budget or of vLLM's config, or vLLM's allocation itself) makes every rank raise before the sinks' gather,
        which the others would otherwise wait in."""
        try:
            caches, refusal = cache.allocate(self, kv_cache_config, vllm_allocate), None
        except Exception as exc:  # re-raised below, once the peers know
            caches, refusal = {}, exc
        refusing = self.ranks_refusing(refusal is not None)
        if refusal is not None:
            raise refusal
        if refusing:
            raise KVPPAllocationError(f"rank {', '.join(map(str, refusing))} of the KVPP group failed its DeepSeek-V4 "
                                      "KV cache allocation (its error says why); this rank stops with it.")
        attention.gather_sinks(self.hooks, self.group)
        return caches

    def ranks_refusing(self, refused: bool) -> list[int]:
        """The group ranks whose allocation failed, as every rank learns it: one all-gather of a flag on the
        group's gloo agreement group (host tensors, whatever the world's backend)."""
        import torch.distributed as dist

        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(self.group_size)]
        dist.all_gather(flags, torch.tensor([int(refused)]), group=self.agreement_group)
        return [rank for rank, flag in enumerate(flags) if flag.item()]

    def note_allocation(self, num_blocks: int, nbytes: int, held: set[str]) -> None:
        self.allocation = {"num_blocks": num_blocks, "allocated_bytes": nbytes, "block_stride": self.rank_stride,
                           "packed_block_stride": self.packed_stride, "cache_layers": len(held)}

    # --- each forward -------------------------------------------------------------------------------

    def exchange(self, layer: int, local_heads: int, query_tokens: int) -> Any:
        """The exchange of `layer`'s rows; a forward's stats open with its first target layer."""
        self.health.check()
        if self.position(layer) == 0:
            self.stats.begin_forward(True, mode="owner", rows={"owner": query_tokens})
        return attention.new_exchange(self, local_heads, query_tokens)

    def note_exchange(self, layer: int) -> None:
        """A forward's stats close with its last target layer's exchange."""
        if self.position(layer) == len(self.target_layers) - 1:
            self.stats.end_forward()

    def snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot(model="deepseek_v4", rank=self.rank, owned_layers=self.owned_layers(),
                                   allocation=dict(self.allocation), broken=self.health.describe())
