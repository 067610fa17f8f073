"""Layer placement for KVPP: owners, scratch slots, bundle layout and the memory budget (pure maths).

Invariants (from the reference implementation unless marked):
- Every target layer has exactly one owner rank. Owners come from the sorted local layer indices,
  ``base, rem = divmod(n, size)``; rank r takes the next ``base + (r < rem)`` indices, so ranges are
  contiguous and lower ranks take the extra layer. The result does not depend on input order.
- Draft/MTP layers get no owner and stay persistent on every rank, unless ``shard_draft_layers``.
- The k-th target layer in execution order uses scratch slot ``k % depth`` on every rank that does not
  own it. Owned layers count in k; local draft layers do not. The plan's `LayerSchedule`
  (`kvpp_fx.schedule`) is the one place that computes it.
- A bundle is laid out component-major: each component holds all ``num_blocks`` blocks, packed back to
  back.
- Every buffer (each owned bundle, each local draft cache, each scratch slot) is 2 MiB aligned, and
  (ours) the padding is counted in the budget: ``bytes_for(num_blocks(a)) <= a`` always holds.
- (ours) A scratch slot holds ``scratch_blocks`` blocks of the largest target bundle (S, compact
  scratch), or the whole pool where no bound is given, plus one 8-byte id per block in front of them
  (that region padded to 4 KiB, so the bundle region is aligned).
  A step's broadcast is packed into the front of the slot and attention reads it through remapped
  block tables, so no other buffer holds cache bytes. S is a fixed cost: it does not grow with the pool.
- (ours) ``scratch_blocks_for(max_model_len, token_budget, block_size)``: the blocks of the longest
  request plus those of one full token budget; a step whose broadcast set does not fit sends the rows
  that do not fit to their owners.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvpp_fx.cache.spec import LayerCacheSpec, ModelCacheSpec
from kvpp_fx.schedule import DEFAULT_DEPTH, MIN_DEPTH, LayerSchedule

ALIGNMENT = 2 * 1024 * 1024
# With whole-layer slots, above this fraction of the pool a step sends whole layers: the owner's gather
# of the listed blocks stops paying for itself. benchmarks/active_blocks.py measured the crossover
# between 0.2 and 0.3 on a 2-core CPU host with gloo (docs/design-blocks.md, "The crossover"). Compact slots
# never send whole layers: a whole layer does not fit.
DEFAULT_CROSSOVER_FRACTION = 0.25
# Each packed block travels with its id (int64), so receivers can check they hold the owner's set.
BLOCK_ID_BYTES = 8
# A slot's ids region is padded to this, so the bundle region after it starts aligned for vector loads
# (vLLM's CPU kernels, device kernels).
IDS_ALIGNMENT = 4096


def ids_region_bytes(blocks: int) -> int:
    """The bytes in front of a scratch slot's bundle region that hold its blocks' ids."""
    return align_up(blocks * BLOCK_ID_BYTES, IDS_ALIGNMENT)


# `KVPPPlan.num_blocks` of a rank whose buffers do not grow with the pool (it owns no layer and its
# slots are compact): the group's pool is then bounded by the other ranks.
UNBOUNDED_BLOCKS = 1 << 62


def scratch_blocks_for(max_model_len: int, token_budget: int, block_size: int) -> int:
    """S: the blocks one step's broadcast needs at most: the longest request's blocks, and the blocks a
    full token budget of other requests' new tokens fills."""
    for name, value in (("max_model_len", max_model_len), ("token_budget", token_budget),
                        ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return -(-max_model_len // block_size) + -(-token_budget // block_size)


class PoolTooSmallError(ValueError):
    """The pool cannot hold the longest request next to another, or is narrower than a scratch slot."""


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def assign_owners(layer_indices: Iterable[int], group_size: int) -> dict[int, int]:
    """Map each layer index to the rank (0-based, within the group) that owns it."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}.")
    ordered = sorted(layer_indices)
    if len(set(ordered)) != len(ordered):
        raise ValueError(f"layer indices must be unique, got {ordered}.")
    base, rem = divmod(len(ordered), group_size)
    owners: dict[int, int] = {}
    start = 0
    for rank in range(group_size):
        count = base + (1 if rank < rem else 0)
        for index in ordered[start:start + count]:
            owners[index] = rank
        start += count
    return owners


@dataclass(frozen=True)
class BufferPlan:
    """One physical buffer of a rank: ``kind`` is "persistent", "draft" or "scratch".

    It holds ``fixed_blocks`` blocks where given (a compact scratch slot), else one per pool block.
    """

    kind: str
    key: int  # the layer index for persistent/draft buffers, the slot for scratch buffers
    bytes_per_block: int  # a scratch slot's includes each block's 8-byte id
    fixed_blocks: int | None = None

    @property
    def name(self) -> str:
        if self.kind == "scratch":
            return f"scratch[{self.key}]"
        return f"{self.kind}[layer {self.key}]"

    def blocks(self, num_blocks: int) -> int:
        return num_blocks if self.fixed_blocks is None else self.fixed_blocks

    def nbytes(self, num_blocks: int) -> int:
        blocks = self.blocks(num_blocks)
        if self.kind == "scratch":  # the ids region, padded, then the bundle region
            return align_up(ids_region_bytes(blocks) + blocks * (self.bytes_per_block - BLOCK_ID_BYTES))
        return align_up(blocks * self.bytes_per_block)


@dataclass(frozen=True)
class ComponentLayout:
    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class KVPPPlan:
    """Where each layer's cache lives within one KVPP group.

    ``layers`` restricts the plan to a pipeline stage's local layers (default: all of ``spec``).
    ``scratch_blocks``: S, the blocks of each scratch slot (compact scratch; `scratch_blocks_for`);
    None keeps whole-layer slots, one block per pool block.
    """

    spec: ModelCacheSpec
    group_size: int
    depth: int = DEFAULT_DEPTH
    shard_draft_layers: bool = False
    layers: tuple[int, ...] | None = None
    scratch_blocks: int | None = None
    request_blocks: int | None = None  # the longest request's blocks (from max_model_len), if bounded
    owners: Mapping[int, int] = field(init=False, compare=False, repr=False)
    target_layers: tuple[int, ...] = field(init=False, compare=False)
    local_draft_layers: tuple[int, ...] = field(init=False, compare=False)
    _schedule: LayerSchedule = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}.")
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < MIN_DEPTH:
            raise ValueError(f"scratch depth must be at least {MIN_DEPTH}, got {self.depth!r}.")
        if self.scratch_blocks is not None and (isinstance(self.scratch_blocks, bool)
                                                or not isinstance(self.scratch_blocks, int) or self.scratch_blocks < 1):
            raise ValueError(f"scratch_blocks must be None or a positive int, got {self.scratch_blocks!r}.")
        if self.request_blocks is not None and (isinstance(self.request_blocks, bool)
                                                or not isinstance(self.request_blocks, int) or self.request_blocks < 1):
            raise ValueError(f"request_blocks must be None or a positive int, got {self.request_blocks!r}.")
        local = self._local_layer_specs()
        targets = tuple(l.index for l in local if not l.is_draft or self.shard_draft_layers)
        drafts = tuple(l.index for l in local if l.is_draft and not self.shard_draft_layers)
        object.__setattr__(self, "layers", tuple(l.index for l in local))
        object.__setattr__(self, "target_layers", targets)
        object.__setattr__(self, "local_draft_layers", drafts)
        object.__setattr__(self, "owners", MappingProxyType(assign_owners(targets, self.group_size)))
        object.__setattr__(self, "_schedule", LayerSchedule.from_plan(self))

    @classmethod
    def for_requests(cls, spec: ModelCacheSpec, group_size: int, *, max_model_len: int | None = None,
                     token_budget: int | None = None, scratch_blocks: int | None = None,
                     **options: Any) -> KVPPPlan:
        """A plan whose slots hold what a step can read: S from `max_model_len` and `token_budget`
        (`scratch_blocks_for`), or `scratch_blocks` if given; whole-layer slots when neither is."""
        request_blocks = None
        if max_model_len is not None:
            if token_budget is None:
                raise ValueError("max_model_len bounds the scratch slots only with the token budget.")
            request_blocks = -(-max_model_len // spec.block_size)
            if scratch_blocks is None:
                scratch_blocks = scratch_blocks_for(max_model_len, token_budget, spec.block_size)
        return cls(spec, group_size, scratch_blocks=scratch_blocks, request_blocks=request_blocks, **options)

    def _local_layer_specs(self) -> tuple[LayerCacheSpec, ...]:
        if self.layers is None:
            chosen = self.spec.layers
        else:
            chosen = tuple(self.spec.layer(i) for i in self.layers)
        # Execution order is ascending layer index; draft layers run after the target model.
        return tuple(sorted(chosen, key=lambda l: (l.is_draft, l.index)))

    # --- ownership and slots -------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.group_size > 1

    def owner(self, layer: int) -> int | None:
        """The owner rank of a target layer; None for a local draft layer."""
        if layer in self.owners:
            return self.owners[layer]
        if layer in self.local_draft_layers:
            return None
        raise KeyError(f"layer {layer} is not in this plan.")

    def owned_layers(self, rank: int) -> tuple[int, ...]:
        self._check_rank(rank)
        return tuple(i for i in self.target_layers if self.owners[i] == rank)

    def is_local(self, layer: int, rank: int) -> bool:
        """Whether `rank` keeps `layer` persistently (owned target or local draft)."""
        return layer in self.local_draft_layers or self.owner(layer) == rank

    def slot(self, layer: int) -> int:
        """The scratch slot of a target layer (`LayerSchedule.slot`)."""
        return self._schedule.slot(layer)

    def scratch_slot(self, layer: int, rank: int) -> int | None:
        """The scratch slot `rank` reads `layer` from, or None where the layer is local to it."""
        if self.is_local(layer, rank):
            return None
        return self.slot(layer)

    def schedule(self) -> LayerSchedule:
        """The order of the kvpp ops in every forward of this plan, and their slots."""
        return self._schedule

    # --- sizes -----------------------------------------------------------------------------------

    def bundle_bytes_per_block(self, layer: int) -> int:
        return self.spec.bytes_per_block(layer)

    @property
    def largest_target_bytes_per_block(self) -> int:
        return max((self.bundle_bytes_per_block(i) for i in self.target_layers), default=0)

    def needs_scratch(self, rank: int) -> bool:
        """Every rank of an enabled group: it receives the layers it does not own, and packs the blocks of
        the ones it owns into its own slot (a rank that owns every layer of a stage included)."""
        return self.enabled and bool(self.target_layers)

    def buffers(self, rank: int) -> tuple[BufferPlan, ...]:
        """The physical buffers `rank` allocates, in allocation order."""
        owned = [BufferPlan("persistent", i, self.bundle_bytes_per_block(i)) for i in self.owned_layers(rank)]
        drafts = [BufferPlan("draft", i, self.bundle_bytes_per_block(i)) for i in self.local_draft_layers]
        scratch = []
        if self.needs_scratch(rank):
            scratch = [BufferPlan("scratch", s, self.largest_target_bytes_per_block + BLOCK_ID_BYTES,
                                  self.scratch_blocks) for s in range(self.depth)]
        return tuple(owned + drafts + scratch)

    @property
    def compact(self) -> bool:
        """Whether scratch slots hold S blocks rather than the whole pool."""
        return self.scratch_blocks is not None

    def slot_blocks(self, num_blocks: int) -> int:
        """Blocks one scratch slot holds for a pool of `num_blocks`: most blocks one broadcast carries."""
        return num_blocks if self.scratch_blocks is None else self.scratch_blocks

    def whole_layer(self) -> KVPPPlan:
        """The same plan with whole-layer slots."""
        return self.with_(scratch_blocks=None)

    def check_pool(self, num_blocks: int) -> None:
        """A pool that holds the longest request and room for another, and no slot wider than the pool;
        raises `PoolTooSmallError` naming the bound otherwise."""
        if self.request_blocks is not None and num_blocks <= self.request_blocks:
            raise PoolTooSmallError(
                f"the pool of {num_blocks:,} blocks of {self.spec.block_size} tokens holds no other request next "
                f"to one of max_model_len ({self.request_blocks:,} blocks); lower max_model_len below "
                f"{(num_blocks - 1) * self.spec.block_size:,} tokens or give more KV memory.")
        if self.scratch_blocks is not None and self.scratch_blocks > num_blocks:
            raise PoolTooSmallError(
                f"scratch slots of {self.scratch_blocks:,} blocks are wider than the pool of {num_blocks:,} blocks; "
                "lower max_model_len or the token budget, or give no bound (whole-layer slots).")

    def replicated_buffers(self) -> tuple[BufferPlan, ...]:
        """The buffers of the same stage without KVPP: every layer persistent on every rank."""
        return tuple(
            BufferPlan("draft" if i in self.local_draft_layers else "persistent", i, self.bundle_bytes_per_block(i))
            for i in self.layers
        )

    def persistent_bytes_per_block(self, rank: int) -> int:
        return sum(b.bytes_per_block for b in self.buffers(rank) if b.kind in ("persistent", "draft"))

    def scratch_bytes_per_block(self, rank: int) -> int:
        """Scratch bytes per pool block: 0 with compact slots, whose bytes do not grow with the pool."""
        return sum(b.bytes_per_block for b in self.buffers(rank) if b.kind == "scratch" and b.fixed_blocks is None)

    def fixed_bytes(self, rank: int) -> int:
        """Bytes `rank` allocates whatever the pool: its compact scratch slots, padding included."""
        return sum(b.nbytes(0) for b in self.buffers(rank) if b.fixed_blocks is not None)

    def bytes_for(self, num_blocks: int, rank: int) -> int:
        """Allocated bytes for `num_blocks` blocks on `rank`, 2 MiB padding included."""
        return _cost(self.buffers(rank), num_blocks)

    def num_blocks(self, available_bytes: int, rank: int | None = None) -> int:
        """Most blocks that fit in `available_bytes` on `rank` (default: the worst rank)."""
        if rank is None:
            return min(self.num_blocks(available_bytes, r) for r in range(self.group_size))
        return _max_blocks(self.buffers(rank), available_bytes)

    def replicated_num_blocks(self, available_bytes: int) -> int:
        return _max_blocks(self.replicated_buffers(), available_bytes)

    def capacity_ratio(self, available_bytes: int) -> float:
        """Blocks with KVPP (worst rank, as the engine takes it) / blocks replicated, same memory."""
        replicated = self.replicated_num_blocks(available_bytes)
        return self.num_blocks(available_bytes) / replicated if replicated else math.inf

    def formula_capacity_ratio(self, available_bytes: int | None = None) -> float:
        """The unaligned ratio: replicated blocks over the worst rank's blocks, block ids left out.

        Whole-layer slots: ``L / (ceil(L/N) + depth)``. Compact slots of S blocks, with ``M`` bytes per
        rank and ``b`` bytes per block of one layer (uniform layers, no drafts):
        ``L / ceil(L/N) * (1 - depth * S * b / M)``, which needs `available_bytes`.
        """
        replicated = sum(b.bytes_per_block for b in self.replicated_buffers())
        worst = max(self.persistent_bytes_per_block(r) + self.scratch_bytes_per_block(r)
                    - self.depth * BLOCK_ID_BYTES * (self.scratch_bytes_per_block(r) > 0)
                    for r in range(self.group_size))
        if not self.compact or not self.enabled:
            return replicated / worst
        if available_bytes is None:
            raise ValueError("a compact-scratch plan's formula ratio needs the memory per rank.")
        slots = self.depth * self.scratch_blocks * self.largest_target_bytes_per_block
        return replicated / worst * max(0.0, 1.0 - slots / available_bytes)

    def broadcast_bytes_per_forward(self, num_blocks: int) -> int:
        """Bytes each forward with history broadcasts: every target bundle once, whole."""
        if not self.enabled:
            return 0
        return sum(num_blocks * self.bundle_bytes_per_block(i) for i in self.target_layers)

    def uses_active_blocks(self, active_blocks: int, num_blocks: int,
                           crossover: float = DEFAULT_CROSSOVER_FRACTION) -> bool:
        """Whether a step reading `active_blocks` of `num_blocks` sends those blocks packed, not whole
        layers: always with compact slots, up to the crossover with whole-layer ones."""
        return self.enabled and (self.compact or active_blocks <= crossover * num_blocks)

    def active_broadcast_bytes(self, layer: int, active_blocks: int) -> int:
        """Bytes of one layer's active-block broadcast: the listed blocks of every component, and their ids."""
        return active_blocks * (self.bundle_bytes_per_block(layer) + BLOCK_ID_BYTES)

    def layout(self, layer: int, num_blocks: int) -> tuple[ComponentLayout, ...]:
        """Component-major ``(offset, size)`` of each component in the layer's bundle."""
        spec = self.spec.layer(layer)
        out, offset = [], 0
        for comp in spec.components:
            size = num_blocks * comp.bytes_per_block(self.spec.block_size)
            out.append(ComponentLayout(comp.name, offset, size))
            offset += size
        return tuple(out)

    def with_(self, **changes) -> KVPPPlan:
        fields = dict(spec=self.spec, group_size=self.group_size, depth=self.depth,
                      shard_draft_layers=self.shard_draft_layers, layers=self.layers,
                      scratch_blocks=self.scratch_blocks, request_blocks=self.request_blocks)
        fields.update(changes)
        return KVPPPlan(**fields)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.group_size:
            raise ValueError(f"rank {rank} is outside the group of size {self.group_size}.")


def _cost(buffers: Iterable[BufferPlan], num_blocks: int) -> int:
    return sum(b.nbytes(num_blocks) for b in buffers)


def _max_blocks(buffers: tuple[BufferPlan, ...], available_bytes: int) -> int:
    if available_bytes < 0:
        raise ValueError(f"available bytes must be non-negative, got {available_bytes}.")
    per_block = sum(b.bytes_per_block for b in buffers if b.fixed_blocks is None)
    fixed = _cost((b for b in buffers if b.fixed_blocks is not None), 0)
    if fixed > available_bytes or not buffers:
        return 0
    if per_block == 0:  # only compact slots (a rank that owns no layer): any pool fits
        return UNBOUNDED_BLOCKS
    lo, hi = 0, int((available_bytes - fixed) // per_block)  # padding only ever lowers this bound
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _cost(buffers, mid) <= available_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
