"""Per-step cost model that picks broadcast mode or owner mode (Python and numpy, no torch).

Broadcast mode moves, per layer, the blocks the step reads (or the whole layer) from the owner to the
other ranks; that is what `KVPPPlan.active_broadcast_bytes` counts. Owner mode moves the queries of
the other ranks' heads to the owner and their outputs back: per layer, the owner's link carries
``(N - 1) / N * query_tokens * heads * (q_width + out_width) * itemsize`` bytes, whatever the context.
In exchange the owner computes attention for all heads instead of its share, and the two collectives
cannot hide behind compute (the queries exist only just before attention).

Invariant: `choose_mode` is a pure function of its frozen inputs, so every rank that passes the same
step gets the same choice (the runtime's per-forward agreement checks it anyway).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import enum

from kvpp_fx.cache.block_ids import EMPTY, BlockIds, difference, union


class Mode(str, enum.Enum):
    """How a forward moves attention's inputs: each layer's cache to the ranks (broadcast), the queries to
    each layer's owner and the outputs back (owner), per request the cheaper of the two (auto; a forward
    with requests on both paths is hybrid). Members compare and hash as their strings."""

    BROADCAST = "broadcast"
    OWNER = "owner"
    AUTO = "auto"
    HYBRID = "hybrid"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)




# What a user or a caller of `KVPPRuntime.forward` may ask for; hybrid is an outcome, never asked.
KVPP_MODES = (Mode.BROADCAST, Mode.OWNER, Mode.AUTO)
BROADCAST, OWNER, AUTO, HYBRID = Mode.BROADCAST, Mode.OWNER, Mode.AUTO, Mode.HYBRID


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


def max_decode_rows(max_num_seqs: int, speculative_tokens: int, token_budget: int) -> int:
    """The most decode rows one step can hold: every request with its speculative tokens, within the
    step's token budget."""
    return min(max_num_seqs * (1 + speculative_tokens), token_budget)


def scored_pairs(query_tokens: int, history: int, topk: int | None = None) -> int:
    """The (query, key) pairs a request's attention scores in a step: its j-th query token (j = 1..query_tokens,
    after `history` computed tokens) scores every earlier token and itself, ``history + j``, or at most `topk`
    of them under sparse attention."""
    full = query_tokens if topk is None else max(0, min(query_tokens, topk - history))
    return full * history + full * (full + 1) // 2 + (query_tokens - full) * (topk or 0)


@dataclass(frozen=True)
class AttentionShape:
    """What owner mode ships per query token and head, for every target layer.

    For absorbed MLA, a head's query is ``kv_lora_rank + qk_rope_head_dim`` values (576 for DeepSeek-V3)
    and its output ``kv_lora_rank`` values (512).
    """

    num_heads: int   # all heads of the layer, over the whole group
    q_width: int     # values sent to the owner per head and query token
    out_width: int   # values sent back per head and query token
    itemsize: int    # bytes per value

    def __post_init__(self) -> None:
        for name in ("num_heads", "q_width", "out_width", "itemsize"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionShape.{name} must be a positive int, got {value!r}.")

    def split(self, group_size: int) -> int:
        """Heads per rank; owner mode needs them to split evenly."""
        _check_count("group_size", group_size, minimum=1)
        if self.num_heads % group_size:
            raise ValueError(f"{self.num_heads} heads do not split over a group of {group_size}.")
        return self.num_heads // group_size

    def owner_exchange_peak_bytes(self, query_tokens: int, group_size: int) -> int:
        """Device memory one layer's owner call holds at its peak on the owner, outside any budget vLLM
        measures: its own packed queries, every rank's gathered and then concatenated, the output over all
        heads and its per-rank parts (each with a status value), and the part it receives back."""
        _check_count("query_tokens", query_tokens, minimum=0)
        per_rank = query_tokens * self.split(group_size)
        values = per_rank * (self.q_width + self.out_width) * (1 + 2 * group_size) + group_size + 1
        return values * self.itemsize

    def owner_bytes_per_layer(self, query_tokens: int, group_size: int) -> int:
        """Bytes the owner's link carries for one layer: the other ranks' queries in, their outputs out."""
        _check_count("query_tokens", query_tokens, minimum=0)
        per_rank = query_tokens * self.split(group_size) * (self.q_width + self.out_width) * self.itemsize
        return (group_size - 1) * per_rank

    def attention_flops(self, attention_pairs: int, heads: int) -> float:
        """Multiply-adds x 2 of absorbed attention over `attention_pairs` (query, context token) pairs."""
        return 2.0 * attention_pairs * heads * (self.q_width + self.out_width)


@dataclass(frozen=True)
class LinkModel:
    """The numbers the choice depends on. The defaults describe the CPU bench: gloo between two
    processes on one 2-core host moves 16 MiB broadcasts at about 2.7 GB/s, and a small broadcast,
    gather or scatter costs 0.25-0.5 ms. A device link is some 100x faster on both counts."""

    bytes_per_s: float = 2.7e9           # one rank's link bandwidth
    latency_s: float = 400e-6            # fixed cost of one collective
    attention_flops_per_s: float = 20e9  # the owner's attention throughput

    def __post_init__(self) -> None:
        for name in ("bytes_per_s", "attention_flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LinkModel.{name} must be positive, got {getattr(self, name)!r}.")
        if not self.latency_s >= 0:
            raise ValueError(f"LinkModel.latency_s must be >= 0, got {self.latency_s!r}.")


@dataclass(frozen=True)
class StepLoad:
    """What one forward does: its query tokens and the (query, context token) pairs attention scores."""

    query_tokens: int
    attention_pairs: int

    def __post_init__(self) -> None:
        for name in ("query_tokens", "attention_pairs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StepLoad.{name} must be a non-negative int, got {value!r}.")


@dataclass(frozen=True)
class ModeChoice:
    """The chosen mode and both sides of the comparison, per layer."""

    mode: str
    broadcast_bytes: int
    owner_bytes: int
    broadcast_s: float
    owner_s: float


def broadcast_seconds(broadcast_bytes: int, link: LinkModel) -> float:
    _check_count("broadcast_bytes", broadcast_bytes, minimum=0)
    if broadcast_bytes == 0:
        return 0.0
    return link.latency_s + broadcast_bytes / link.bytes_per_s


def owner_seconds(shape: AttentionShape, load: StepLoad, group_size: int, link: LinkModel) -> float:
    """Two collectives plus the extra attention the owner computes for the other ranks' heads."""
    extra_heads = shape.num_heads - shape.split(group_size)
    compute = shape.attention_flops(load.attention_pairs, extra_heads) / link.attention_flops_per_s
    moved = shape.owner_bytes_per_layer(load.query_tokens, group_size) / link.bytes_per_s
    return 2 * link.latency_s + moved + compute


def choose_mode(shape: AttentionShape, load: StepLoad, broadcast_bytes: int, group_size: int,
                link: LinkModel) -> ModeChoice:
    """The cheaper mode for one layer of this step (broadcast on a tie: it overlaps with compute)."""
    b_s = broadcast_seconds(broadcast_bytes, link)
    o_s = owner_seconds(shape, load, group_size, link)
    return ModeChoice(OWNER if o_s < b_s else BROADCAST, broadcast_bytes,
                      shape.owner_bytes_per_layer(load.query_tokens, group_size), b_s, o_s)


@dataclass(frozen=True)
class RequestRows:
    """One request's rows in a step, or a group of requests that must take one path together (vLLM's
    decode rows: one attention call serves them all).

    ``blocks``: the ids of the blocks with history the rows read (what broadcast mode would move for
    them); ``written``: the blocks they write that hold no history (a position in a non-owner's packed
    slot, no bytes); ``owner_capable``: whether their attention can run on the layer's owner (vLLM: its
    decode rows, not its prefill rows). Both sets are held as `BlockIds` (any iterable of ints is taken),
    so a set that no broadcast needs is never built (`BlockIds.lazy`).
    """

    query_tokens: int
    attention_pairs: int
    blocks: BlockIds = EMPTY
    owner_capable: bool = True
    written: BlockIds = EMPTY

    def __post_init__(self) -> None:
        StepLoad(self.query_tokens, self.attention_pairs)  # the same checks
        for name in ("blocks", "written"):
            try:
                object.__setattr__(self, name, BlockIds.of(getattr(self, name)))
            except (TypeError, ValueError):
                raise ValueError(f"RequestRows.{name} must be int block ids, got {getattr(self, name)!r}.") from None

    @property
    def footprint(self) -> BlockIds:
        """Every block the rows touch: what they take of a packed slot."""
        return union((self.blocks, self.written))


@dataclass(frozen=True)
class RowChoice:
    """Each request's path, and what the step then moves per layer."""

    modes: tuple[str, ...]  # per request, BROADCAST or OWNER
    owner_tokens: int  # query tokens gathered to each layer's owner
    owner_pairs: int
    broadcast_blocks: BlockIds  # sorted union of the broadcast requests' blocks
    broadcast_bytes: int  # per layer
    owner_bytes: int  # per layer, on the owner's link
    why: str = ""
    broadcast_written: BlockIds = EMPTY  # sorted union of the broadcast requests' written blocks

    @property
    def hybrid(self) -> bool:
        return OWNER in self.modes and BROADCAST in self.modes

    def rows(self, mode: str, requests: tuple[RequestRows, ...]) -> int:
        return sum(r.query_tokens for r, m in zip(requests, self.modes) if m == mode)


@dataclass(frozen=True)
class BroadcastCost:
    """What a broadcast of n blocks moves per layer: n blocks with their ids, or the whole layer once n
    passes the active-block limit (the crossover fraction of the pool, with whole-layer slots).
    ``slot_blocks``: with compact slots, S, the most blocks the broadcast rows of a step may touch."""

    block_bytes: int  # one block of one layer, with its id (`KVPPPlan.active_broadcast_bytes` of one)
    max_active_blocks: int
    layer_bytes: int
    slot_blocks: int | None = None

    def bytes(self, blocks: int) -> int:
        if blocks == 0:
            return 0
        return blocks * self.block_bytes if blocks <= self.max_active_blocks else self.layer_bytes


def choose_rows(shape: AttentionShape, requests: tuple[RequestRows, ...], mode: str,
                broadcast: BroadcastCost | int, group_size: int, link: LinkModel) -> RowChoice:
    """Each request's path for one step: ``"broadcast"`` sends every request's history; ``"owner"``
    sends every owner-capable request to the owner; ``"auto"`` sends an owner-capable request to the
    owner when that costs less than broadcasting its blocks (bytes and the owner's extra attention;
    the fixed cost of the collectives is shared by the step), then keeps the hybrid only if it beats
    broadcasting everything, collectives included. ``broadcast``: what a broadcast of n blocks moves
    (a `BroadcastCost`, or one block's bytes when there is no whole-layer limit)."""
    if mode not in KVPP_MODES:
        raise ValueError(f"mode must be one of {[str(m) for m in KVPP_MODES]}, got {mode!r}.")
    if not isinstance(broadcast, BroadcastCost):
        _check_count("block_bytes", broadcast, minimum=1)
        broadcast = BroadcastCost(broadcast, 1 << 62, 0)
    requests = tuple(requests)

    def owner_s(rows: RequestRows) -> float:
        return owner_seconds(shape, StepLoad(rows.query_tokens, rows.attention_pairs), group_size, link) \
            - 2 * link.latency_s

    if mode == BROADCAST:
        modes = (BROADCAST,) * len(requests)
    elif mode == OWNER:
        modes = tuple(OWNER if r.owner_capable else BROADCAST for r in requests)
    else:
        modes = tuple(OWNER if r.owner_capable and r.query_tokens and
                      owner_s(r) < broadcast.bytes(len(r.blocks)) / link.bytes_per_s else BROADCAST
                      for r in requests)
    fitted = fit_rows(requests, modes, broadcast.slot_blocks)
    if fitted != modes:
        choice = _row_choice(shape, requests, fitted, broadcast, group_size)
        return dataclasses.replace(choice, why=f"the broadcast rows touch more blocks than a scratch slot's "
                                               f"{broadcast.slot_blocks}: the rows that do not fit go to the owner")
    choice = _row_choice(shape, requests, modes, broadcast, group_size)
    if mode == AUTO and OWNER in modes and fit_rows(requests, (BROADCAST,) * len(requests),
                                                      broadcast.slot_blocks) == (BROADCAST,) * len(requests):
        everything = _row_choice(shape, requests, (BROADCAST,) * len(requests), broadcast, group_size)
        owner_total = 2 * link.latency_s + sum(owner_s(r) for r, m in zip(requests, modes) if m == OWNER)
        if owner_total + broadcast_seconds(choice.broadcast_bytes, link) >= \
                broadcast_seconds(everything.broadcast_bytes, link):
            return dataclasses.replace(everything, why="the collectives' fixed cost outweighs what the owner saves")
    return choice


def fit_rows(requests: tuple[RequestRows, ...], modes: tuple[str, ...], slot_blocks: int | None) -> tuple[str, ...]:
    """`modes` with owner-capable broadcast requests sent to the owner, the widest first, until the
    broadcast requests' blocks fit in a slot of `slot_blocks` (None: no bound). What cannot move stays:
    a set still too wide is refused where the slot is packed (`ScratchOverflowError`)."""
    if slot_blocks is None:
        return modes
    modes = list(modes)

    def touched() -> int:
        return len(union(r.footprint for r, m in zip(requests, modes) if m == BROADCAST))

    movable = sorted((k for k, r in enumerate(requests) if modes[k] == BROADCAST and r.owner_capable),
                     key=lambda k: (-len(requests[k].footprint), k))
    for k in movable:
        if touched() <= slot_blocks:
            break
        modes[k] = OWNER
    return tuple(modes)


def _row_choice(shape: AttentionShape, requests: tuple[RequestRows, ...], modes: tuple[str, ...],
                broadcast: BroadcastCost, group_size: int) -> RowChoice:
    owners = [r for r, m in zip(requests, modes) if m == OWNER]
    blocks = union(r.blocks for r, m in zip(requests, modes) if m == BROADCAST)
    written = difference(union(r.written for r, m in zip(requests, modes) if m == BROADCAST), blocks)
    owner_tokens = sum(r.query_tokens for r in owners)
    return RowChoice(modes, owner_tokens, sum(r.attention_pairs for r in owners), blocks,
                     broadcast.bytes(len(blocks)), shape.owner_bytes_per_layer(owner_tokens, group_size),
                     broadcast_written=written)
