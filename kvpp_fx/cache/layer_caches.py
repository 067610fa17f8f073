"""Models whose layers hold several caches of different shapes: DeepSeek-V4 (plain Python, no torch).

A DeepSeek-V4 attention layer (vLLM 0.32, ``vllm/models/deepseek_v4/``) holds up to five caches, each
replicated on every TP rank without KVPP (``max_tp_shards=1``):
- ``compressed_kv``: one row per ``ratio`` tokens (ratio 4 or 128), 256-token blocks;
- ``indexer_keys`` (ratio-4 layers): one row of fp8 keys and an fp32 scale per 4 tokens, 256-token blocks;
- ``window_kv`` (every layer): the rows of a request's last ``sliding_window`` tokens, 64-token blocks;
- ``compressor_state`` (fp32 ``2 * coff * head_dim`` values per token, ``coff`` 2 at ratio 4 and 1 at 128)
  over a request's last ``coff * ratio`` tokens, 4- or 8-token blocks, and ``indexer_compressor_state``
  (ratio-4 layers) over its last 8 tokens.
A KV row is 584 bytes under fp8_ds_mla (448 fp8 values, 64 bf16 RoPE values, 8 scale bytes), the default on
a GPU, or ``head_dim`` bf16 values; vLLM pads every page (one block of one cache) to 576 bytes under
fp8_ds_mla and to 512 otherwise.

Invariants:
- A cache grows with the context (``window is None``: a page per ``block_size`` tokens) or keeps a request's
  last ``window`` tokens: at most ``ceil((window - 1) / block_size) + 1`` pages, what vLLM's sliding-window
  manager keeps once a request decodes.
- One owner per target layer holds all of the layer's caches; draft (MTP) layers stay on every rank.
- Owners balance the bytes one request of ``reference_tokens`` costs (`balanced_owners`): the costliest
  layer first, each to the rank holding least so far; ties go to the lower layer index and the lower rank.
  Layers of equal cost keep the contiguous split of `assign_owners`.
- Every row of a layer runs on its owner (owner mode), so a rank holds its layers' caches and nothing
  else: no scratch slot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvpp_fx.cache.placement import assign_owners
from kvpp_fx.cache.spec import LAYER_CACHES_MODEL_TYPES

DEEPSEEK_V4_KV_DTYPES = ("fp8", "bf16")  # fp8: vLLM's fp8_ds_mla layout, its default on a GPU
DEEPSEEK_V4_BLOCK_SIZE = 256  # vLLM's only block size for DeepSeek-V4's compressed caches
WINDOW_BLOCK_SIZE = 64
ACTIVATION_BYTES = 2  # the bf16 queries and outputs owner mode ships



class LayerCachesError(ValueError):
    """A DeepSeek-V4 config without what its caches depend on, or an option its caches do not have."""


@dataclass(frozen=True)
class Cache:
    """One cache of a layer: rows of `row_bytes`, one per `tokens_per_row` tokens, in pages of `block_size`
    tokens padded to `page_alignment` bytes; `window` bounds the tokens a request keeps (None: all)."""

    name: str
    row_bytes: int
    tokens_per_row: int
    block_size: int
    page_alignment: int
    window: int | None = None

    @property
    def page_bytes(self) -> int:
        rows = -(-self.block_size // self.tokens_per_row)
        return -(-rows * self.row_bytes // self.page_alignment) * self.page_alignment

    @property
    def grows(self) -> bool:
        return self.window is None

    @property
    def most_pages(self) -> int | None:
        """The pages a request keeps at most (None: unbounded)."""
        return None if self.window is None else -(-(self.window - 1) // self.block_size) + 1

    def pages(self, context_tokens: int) -> int:
        """Pages one request of `context_tokens` tokens holds."""
        growing = -(-context_tokens // self.block_size)
        return growing if self.window is None else min(growing, self.most_pages)

    def request_bytes(self, context_tokens: int) -> int:
        return self.pages(context_tokens) * self.page_bytes


@dataclass(frozen=True)
class LayerCaches:
    index: int
    compress_ratio: int  # 0: window-only
    caches: tuple[Cache, ...]
    is_draft: bool = False

    def request_bytes(self, context_tokens: int) -> int:
        return sum(c.request_bytes(context_tokens) for c in self.caches)

    @property
    def bytes_per_token(self) -> float:
        """Bytes per context token of the caches that grow with the context."""
        return sum(c.page_bytes / c.block_size for c in self.caches if c.grows)

    @property
    def bounded_bytes(self) -> int:
        """Bytes of the caches a request keeps whatever its length (at their longest)."""
        return sum(c.most_pages * c.page_bytes for c in self.caches if not c.grows)


@dataclass(frozen=True)
class DeepseekV4Geometry:
    num_heads: int
    head_dim: int
    rope_dim: int
    index_head_dim: int
    index_topk: int
    window: int


@dataclass(frozen=True)
class LayerCachesModel:
    name: str
    layers: tuple[LayerCaches, ...]
    geometry: DeepseekV4Geometry
    kv_dtype: str

    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if not layer.is_draft)

    def layer(self, index: int) -> LayerCaches:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise KeyError(f"model {self.name!r} has no layer {index}.")

    def request_bytes(self, context_tokens: int, layers: tuple[int, ...] | None = None) -> int:
        chosen = self.layers if layers is None else tuple(self.layer(i) for i in layers)
        return sum(layer.request_bytes(context_tokens) for layer in chosen)


def is_deepseek_v4(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") in LAYER_CACHES_MODEL_TYPES


def deepseek_v4_caches(config: Mapping[str, Any], *, name: str = "deepseek-v4", kv_dtype: str = "fp8",
                       include_mtp: bool = False) -> LayerCachesModel:
    """Every layer's caches as vLLM 0.32 allocates them for a DeepSeek-V4 ``config.json`` mapping."""
    if kv_dtype not in DEEPSEEK_V4_KV_DTYPES:
        raise LayerCachesError(f"DeepSeek-V4's KV cache is one of {DEEPSEEK_V4_KV_DTYPES} (fp8: vLLM's "
                               f"fp8_ds_mla), got {kv_dtype!r}.")
    fields = {}
    for key in ("num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim", "index_head_dim",
                "index_topk", "sliding_window"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayerCachesError(f"DeepSeek-V4 config needs a positive integer {key}, got {value!r}.")
        fields[key] = value
    layers_n = fields["num_hidden_layers"]
    nextn = int(config.get("num_nextn_predict_layers") or 0) if include_mtp else 0
    ratios = config.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < layers_n + nextn or any(r not in (0, 1, 4, 128)
                                                                                for r in ratios):
        raise LayerCachesError(f"DeepSeek-V4 config needs compress_ratios (0, 4 or 128) for its {layers_n} layers"
                               f"{f' and {nextn} MTP layer(s)' if nextn else ''}, got {ratios!r}.")
    geometry = DeepseekV4Geometry(fields["num_attention_heads"], fields["head_dim"], fields["qk_rope_head_dim"],
                                  fields["index_head_dim"], fields["index_topk"], fields["sliding_window"])
    layers = tuple(LayerCaches(i, ratios[i] if ratios[i] > 1 else 0,
                               _layer_caches(geometry, ratios[i], kv_dtype), is_draft=i >= layers_n)
                   for i in range(layers_n + nextn))
    return LayerCachesModel(name, layers, geometry, kv_dtype)


def _layer_caches(geometry: DeepseekV4Geometry, ratio: int, kv_dtype: str) -> tuple[Cache, ...]:
    fp8 = kv_dtype == "fp8"
    align = 576 if fp8 else 512
    nope = geometry.head_dim - geometry.rope_dim
    kv_row = nope + 2 * geometry.rope_dim + 8 if fp8 else 2 * geometry.head_dim
    caches = [Cache("window_kv", kv_row, 1, WINDOW_BLOCK_SIZE, align, window=geometry.window)]
    if ratio > 1:
        coff = 2 if ratio == 4 else 1
        caches.append(Cache("compressed_kv", kv_row, ratio, DEEPSEEK_V4_BLOCK_SIZE, align))
        caches.append(Cache("compressor_state", 4 * 2 * coff * geometry.head_dim, 1, 4 if ratio == 4 else 8,
                            align, window=coff * ratio))
    if ratio == 4:
        caches.append(Cache("indexer_keys", geometry.index_head_dim + 4, 4, DEEPSEEK_V4_BLOCK_SIZE, align))
        caches.append(Cache("indexer_compressor_state", 4 * 2 * 2 * geometry.index_head_dim, 1, 4, align,
                            window=8))
    return tuple(caches)


def balanced_owners(weights: Mapping[int, int | float], group_size: int) -> dict[int, int]:
    """Layer -> owner rank, balancing the summed weight of each rank (module docstring)."""
    if len(set(weights.values())) <= 1:
        return assign_owners(weights, group_size)
    load = [0.0] * group_size
    owners = {}
    for layer in sorted(weights, key=lambda i: (-weights[i], i)):
        rank = min(range(group_size), key=lambda r: (load[r], r))
        owners[layer] = rank
        load[rank] += weights[layer]
    return owners


@dataclass(frozen=True)
class LayerCachesPlan:
    """One owner per target layer of a `LayerCachesModel`, over a group of `group_size` ranks."""

    model: LayerCachesModel
    group_size: int
    reference_tokens: int = 131072
    owners: Mapping[int, int] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}.")
        weights = {i: self.model.layer(i).request_bytes(self.reference_tokens) for i in self.model.target_layers}
        object.__setattr__(self, "owners", MappingProxyType(balanced_owners(weights, self.group_size)))

    def owned_layers(self, rank: int) -> tuple[int, ...]:
        return tuple(i for i in self.model.target_layers if self.owners[i] == rank)

    def held_layers(self, rank: int) -> tuple[int, ...]:
        """The layers whose caches `rank` holds: its own, and every draft layer."""
        drafts = tuple(layer.index for layer in self.model.layers if layer.is_draft)
        return self.owned_layers(rank) + drafts

    def request_bytes(self, context_tokens: int, rank: int | None = None) -> int:
        """Bytes one request of `context_tokens` tokens holds on `rank` (None: replicated, every layer)."""
        layers = None if rank is None else self.held_layers(rank)
        return self.model.request_bytes(context_tokens, layers)

    def worst_rank(self, context_tokens: int) -> int:
        return max(range(self.group_size), key=lambda r: (self.request_bytes(context_tokens, r), -r))

    def capacity_ratio(self, context_tokens: int) -> float:
        """Requests of `context_tokens` tokens at equal KV memory: KVPP (worst rank) over replicated."""
        return self.request_bytes(context_tokens) / self.request_bytes(context_tokens, self.worst_rank(
            context_tokens))

    def decode_read_bytes(self, context_tokens: int) -> int:
        """Bytes one decode token of a request reads from the caches, over every target layer: the window's
        rows, and per compressed layer its indexer's sweep over every key and the top-k rows (ratio 4) or
        every compressed row (ratio 128). A broadcast of what the step reads moves this to each non-owner."""
        g = self.model.geometry
        total = 0
        for i in self.model.target_layers:
            layer = self.model.layer(i)
            by_name = {c.name: c for c in layer.caches}
            total += min(context_tokens, g.window) * by_name["window_kv"].row_bytes
            if layer.compress_ratio:
                rows = context_tokens // layer.compress_ratio
                kv_row = by_name["compressed_kv"].row_bytes
                if layer.compress_ratio == 4:
                    total += rows * by_name["indexer_keys"].row_bytes + min(rows, g.index_topk) * kv_row
                else:
                    total += rows * kv_row
        return total

    def owner_exchange_bytes(self) -> int:
        """Bytes one non-owner rank ships per layer and decode token in owner mode: its heads' queries out
        and their outputs back, whatever the context."""
        g = self.model.geometry
        if g.num_heads % self.group_size:
            raise LayerCachesError(f"{g.num_heads} attention heads do not split evenly over {self.group_size} "
                                   "ranks.")
        return 2 * (g.num_heads // self.group_size) * g.head_dim * ACTIVATION_BYTES


def cache_table(plan: LayerCachesPlan, context_tokens: int) -> dict[str, dict[str, Any]]:
    """Per cache name: its page, its bytes per context token (growing caches) or per request (bounded), and
    the bytes one request of `context_tokens` holds replicated and on the worst rank."""
    worst = set(plan.held_layers(plan.worst_rank(context_tokens)))
    out: dict[str, dict[str, Any]] = {}
    for layer in plan.model.layers:
        for cache in layer.caches:
            row = out.setdefault(cache.name, {"layers": 0, "page_bytes": cache.page_bytes, "grows": cache.grows,
                                              "block_size": cache.block_size, "replicated_bytes": 0,
                                              "worst_rank_bytes": 0})
            row["layers"] += 1
            nbytes = cache.request_bytes(context_tokens)
            row["replicated_bytes"] += nbytes
            row["worst_rank_bytes"] += nbytes if layer.index in worst else 0
    for name, row in out.items():
        per_layer = next(c for layer in plan.model.layers for c in layer.caches if c.name == name)
        row["bytes_per_token_per_layer"] = per_layer.page_bytes / per_layer.block_size if per_layer.grows else 0.0
    return out


def layer_caches_report(plan: LayerCachesPlan, available_bytes: int,
                        contexts: tuple[int, ...] = (131072, 1048576)) -> dict[str, Any]:
    """The numbers behind ``kvpp-fx plan`` for a DeepSeek-V4 model: owners, per-cache bytes, requests per
    rank and the capacity ratio at each context, and what a decode step moves."""
    model = plan.model
    ranks = [{"rank": r, "owned_layers": list(plan.owned_layers(r)),
              "bytes_per_token": sum(model.layer(i).bytes_per_token for i in plan.held_layers(r)),
              "bounded_bytes": sum(model.layer(i).bounded_bytes for i in plan.held_layers(r))}
             for r in range(plan.group_size)]
    at = []
    for tokens in contexts:
        replicated, worst = plan.request_bytes(tokens), plan.request_bytes(tokens, plan.worst_rank(tokens))
        at.append({"context_tokens": tokens, "worst_rank": plan.worst_rank(tokens),
                   "replicated_request_bytes": replicated, "worst_rank_request_bytes": worst,
                   "replicated_requests": available_bytes // replicated, "kvpp_requests": available_bytes // worst,
                   "capacity_ratio": replicated / worst, "decode_read_bytes": plan.decode_read_bytes(tokens),
                   "caches": cache_table(plan, tokens)})
    return {"model": model.name, "kind": "deepseek_v4", "group_size": plan.group_size, "kv_dtype": model.kv_dtype,
            "kv_memory_bytes": available_bytes, "reference_tokens": plan.reference_tokens,
            "target_layers": list(model.target_layers),
            "draft_layers": [layer.index for layer in model.layers if layer.is_draft],
            "compress_ratios": {layer.index: layer.compress_ratio for layer in model.layers},
            "replicated_bytes_per_token": sum(layer.bytes_per_token for layer in model.layers),
            "replicated_bounded_bytes": sum(layer.bounded_bytes for layer in model.layers),
            "ranks": ranks, "contexts": at,
            "owner_exchange_bytes_per_layer": plan.owner_exchange_bytes() if plan.group_size > 1 else 0,
            "path": "every row on its layer's owner (owner mode): no scratch slot"}


def ideal_ratio(plan: LayerCachesPlan) -> float:
    """Bytes per context token, replicated over the worst rank's: the ratio as the context grows."""
    per_rank = [sum(plan.model.layer(i).bytes_per_token for i in plan.held_layers(r))
                for r in range(plan.group_size)]
    return sum(layer.bytes_per_token for layer in plan.model.layers) / max(per_rank) if max(per_rank) else math.inf
