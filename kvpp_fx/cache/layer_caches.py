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

vLLM 0.32 packs these caches block-outermost in one pool (`packed_groups`): one KV cache group of every layer's
growing caches (256-token blocks), and groups of the bounded caches of one kind (the window caches, split by
position into as many groups as the growing group's page sum needs; the ratio-4 compressor states; the
ratio-128 ones). A block id belongs to one group at a time and costs the largest group's sum of pages, the
packed block, whichever group holds it: vLLM plans ``available // packed block`` blocks.

Invariants:
- A cache grows with the context (``window is None``: a page per ``block_size`` tokens) or keeps a request's
  last ``window`` tokens: at most ``ceil((window - 1) / block_size) + 1`` pages, what vLLM's sliding-window
  manager keeps once a request decodes.
- One owner per target layer holds all of the layer's caches; draft (MTP) layers stay on every rank.
- A rank's block holds only its layers' pages: in each group they sit back to back, so its block is the largest
  group's sum of its own pages, and vLLM plans ``available // the largest rank's block`` blocks with KVPP.
- Owners minimise that largest block (`balanced_group_owners`): the layer with the largest page sum in one
  group first, each to the rank whose largest group then is least (ties: the least total, then the lower rank).
- Every row of a layer runs on its owner (owner mode), so a rank holds its layers' caches and nothing
  else: no scratch slot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

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

    def cache(self, name: str) -> Cache:
        for cache in self.caches:
            if cache.name == name:
                return cache
        raise KeyError(f"layer {self.index} has no cache {name!r}.")

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
        # fp8 keys and an fp32 scale per 128 of them
        keys_row = geometry.index_head_dim + geometry.index_head_dim // 128 * 4
        caches.append(Cache("indexer_keys", keys_row, 4, DEEPSEEK_V4_BLOCK_SIZE, align))
        caches.append(Cache("indexer_compressor_state", 4 * 2 * 2 * geometry.index_head_dim, 1, 4, align,
                            window=8))
    return tuple(caches)


def packed_groups(model: LayerCachesModel) -> tuple[tuple[tuple[int, str], ...], ...]:
    """vLLM 0.32's KV cache groups of `model`'s caches, as ``(layer, cache name)`` per group (module docstring):
    the growing caches first, then each bounded kind, in layer order; a kind's layers are split by position,
    ``kind[i::n]``, into the fewest groups whose page sums fit the growing group's."""
    growing = tuple((layer.index, c.name) for layer in model.layers for c in layer.caches if c.grows)
    anchor = sum(model.layer(i).cache(name).page_bytes for i, name in growing)
    kinds: dict[tuple[int, int | None], list[int]] = {}
    for layer in model.layers:  # a kind: the bounded caches of one block size and window, per layer
        for cache in layer.caches:
            if not cache.grows:
                kinds.setdefault((cache.block_size, cache.window), [])
                if layer.index not in kinds[(cache.block_size, cache.window)]:
                    kinds[(cache.block_size, cache.window)].append(layer.index)
    groups = [growing] if growing else []
    for (block_size, window), layers in kinds.items():
        def members(i: int) -> tuple[tuple[int, str], ...]:
            return tuple((i, c.name) for c in model.layer(i).caches
                         if not c.grows and (c.block_size, c.window) == (block_size, window))
        per_layer = max(sum(model.layer(i).cache(n).page_bytes for _, n in members(i)) for i in layers)
        count = max(1, -(-len(layers) * per_layer // anchor)) if anchor else 1
        groups += [tuple(m for i in layers[k::count] for m in members(i)) for k in range(count)]
    return tuple(groups)


def balanced_group_owners(loads: Mapping[int, Sequence[int]], group_size: int,
                          base: Sequence[int] = ()) -> dict[int, int]:
    """Layer -> owner rank, from each layer's pages per group (`loads`); every rank starts from `base`, the pages
    of the layers every rank holds (module docstring)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}.")
    width = max((len(v) for v in loads.values()), default=len(base))
    held = [list(base) + [0] * (width - len(base)) for _ in range(group_size)]
    owners = {}
    for layer in sorted(loads, key=lambda i: (-max(loads[i], default=0), -sum(loads[i]), i)):
        def after(rank: int) -> tuple[int, int, int]:
            sums = [a + b for a, b in zip(held[rank], loads[layer])]
            return max(sums, default=0), sum(sums), rank
        rank = min(range(group_size), key=after)
        owners[layer] = rank
        held[rank] = [a + b for a, b in zip(held[rank], loads[layer])]
    return owners


@dataclass(frozen=True)
class LayerCachesPlan:
    """One owner per target layer of a `LayerCachesModel`, over a group of `group_size` ranks, in vLLM's packed
    pool (module docstring)."""

    model: LayerCachesModel
    group_size: int
    groups: tuple[tuple[tuple[int, str], ...], ...] = field(init=False, compare=False)
    owners: Mapping[int, int] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}.")
        targets = self.model.target_layers
        if len(targets) < self.group_size:
            raise LayerCachesError(f"{len(targets)} target layers cannot give each of {self.group_size} ranks a "
                                   f"layer; set the TP size to at most {len(targets)}.")
        groups = packed_groups(self.model)
        object.__setattr__(self, "groups", groups)
        loads = {i: self._pages_per_group((i,)) for i in targets}
        base = self._pages_per_group(tuple(layer.index for layer in self.model.layers if layer.is_draft))
        object.__setattr__(self, "owners", MappingProxyType(balanced_group_owners(loads, self.group_size, base)))

    def _pages_per_group(self, layers: tuple[int, ...]) -> list[int]:
        chosen = set(layers)
        return [sum(self.model.layer(i).cache(name).page_bytes for i, name in group if i in chosen)
                for group in self.groups]

    def owned_layers(self, rank: int) -> tuple[int, ...]:
        return tuple(i for i in self.model.target_layers if self.owners[i] == rank)

    def held_layers(self, rank: int) -> tuple[int, ...]:
        """The layers whose caches `rank` holds: its own, and every draft layer."""
        drafts = tuple(layer.index for layer in self.model.layers if layer.is_draft)
        return self.owned_layers(rank) + drafts

    def block_bytes(self, rank: int | None = None) -> int:
        """The bytes of one block of vLLM's pool on `rank` (None: vLLM's packed block, every layer)."""
        layers = tuple(layer.index for layer in self.model.layers) if rank is None else self.held_layers(rank)
        return max(self._pages_per_group(layers), default=0)

    @property
    def worst_rank(self) -> int:
        return max(range(self.group_size), key=lambda r: (self.block_bytes(r), -r))

    @property
    def capacity_ratio(self) -> float:
        """vLLM's blocks at equal KV memory, KVPP over replicated: the packed block over the largest rank's."""
        return self.block_bytes() / self.block_bytes(self.worst_rank)

    def blocks_per_request(self, context_tokens: int) -> int:
        """The block ids one request of `context_tokens` tokens holds: its pages of each group."""
        total = 0
        for group in self.groups:
            i, name = group[0]
            total += self.model.layer(i).cache(name).pages(context_tokens)
        return total

    def requests(self, available_bytes: int, context_tokens: int, kvpp: bool = True) -> int:
        """Requests of `context_tokens` tokens that fit `available_bytes` per rank, with KVPP (the engine takes the
        block count of the largest rank's block) or replicated."""
        block = self.block_bytes(self.worst_rank) if kvpp else self.block_bytes()
        return available_bytes // block // self.blocks_per_request(context_tokens)

    def request_bytes(self, context_tokens: int, rank: int | None = None) -> int:
        """Bytes of caches one request of `context_tokens` tokens holds on `rank` (None: replicated)."""
        layers = None if rank is None else self.held_layers(rank)
        return self.model.request_bytes(context_tokens, layers)

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
    worst = set(plan.held_layers(plan.worst_rank))
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
    """The numbers behind ``kvpp-fx plan`` for a DeepSeek-V4 model: owners, the blocks of vLLM's pool per rank,
    per-cache bytes, requests per rank at each context, and what a decode step moves."""
    model = plan.model
    ranks = [{"rank": r, "owned_layers": list(plan.owned_layers(r)), "block_bytes": plan.block_bytes(r),
              "blocks": available_bytes // plan.block_bytes(r),
              "bytes_per_token": sum(model.layer(i).bytes_per_token for i in plan.held_layers(r)),
              "bounded_bytes": sum(model.layer(i).bounded_bytes for i in plan.held_layers(r))}
             for r in range(plan.group_size)]
    at = [{"context_tokens": tokens, "blocks_per_request": plan.blocks_per_request(tokens),
           "replicated_requests": plan.requests(available_bytes, tokens, kvpp=False),
           "kvpp_requests": plan.requests(available_bytes, tokens),
           "replicated_request_bytes": plan.request_bytes(tokens),
           "worst_rank_request_bytes": plan.request_bytes(tokens, plan.worst_rank),
           "decode_read_bytes": plan.decode_read_bytes(tokens), "caches": cache_table(plan, tokens)}
          for tokens in contexts]
    groups = [{"caches": len(group), "block_size": model.layer(group[0][0]).cache(group[0][1]).block_size,
               "page_bytes": sum(model.layer(i).cache(n).page_bytes for i, n in group)} for group in plan.groups]
    return {"model": model.name, "kind": "deepseek_v4", "group_size": plan.group_size, "kv_dtype": model.kv_dtype,
            "kv_memory_bytes": available_bytes, "target_layers": list(model.target_layers),
            "draft_layers": [layer.index for layer in model.layers if layer.is_draft],
            "compress_ratios": {layer.index: layer.compress_ratio for layer in model.layers},
            "groups": groups, "packed_block_bytes": plan.block_bytes(), "worst_rank": plan.worst_rank,
            "replicated_blocks": available_bytes // plan.block_bytes(),
            "engine_blocks": available_bytes // plan.block_bytes(plan.worst_rank),
            "capacity_ratio": plan.capacity_ratio, "ideal_ratio": ideal_ratio(plan),
            "replicated_bytes_per_token": sum(layer.bytes_per_token for layer in model.layers),
            "replicated_bounded_bytes": sum(layer.bounded_bytes for layer in model.layers),
            "ranks": ranks, "contexts": at,
            "owner_exchange_bytes_per_layer": plan.owner_exchange_bytes() if plan.group_size > 1 else 0,
            "path": "every row on its layer's owner (owner mode): no scratch slot"}


def ideal_ratio(plan: LayerCachesPlan) -> float:
    """Bytes per context token, replicated over the largest rank's: what a pool paged per cache would give as
    the context grows (vLLM's packed pool gives `LayerCachesPlan.capacity_ratio`)."""
    per_rank = [sum(plan.model.layer(i).bytes_per_token for i in plan.held_layers(r))
                for r in range(plan.group_size)]
    return sum(layer.bytes_per_token for layer in plan.model.layers) / max(per_rank) if max(per_rank) else math.inf
