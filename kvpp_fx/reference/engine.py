"""A small step driver for the reference model (readable, not a serving engine).

Per step: running decodes first (one token, or two with an MTP draft), then a prefill chunk of the
oldest waiting prompt under the token budget. Blocks come from a pool with prefix caching (a full block is keyed by a hash of all tokens
up to its end and reused by later requests). Greedy sampling; MTP drafts are verified greedily, so
speculative output equals plain greedy output.

The same driver runs with KVPP on or off: the only difference is the plan's group size (N or 1).
Either way the model's caches are owned by a `KVPPRuntime`, and each step with a compiled model runs
under ``runtime.forward(has_history)`` with ``has_history = any(num_computed_tokens > 0)`` over the
scheduled requests, as the reference implementation computes it; in owner and auto mode the forward
names each request's rows and blocks (``requests=``), so a step of decodes next to a prefill chunk can
send the decodes to the owners and broadcast the chunk's history (a hybrid step). The engine owns both the backend and
the runtime, so it is what tells the runtime, after each step, which layers the graphs compiled in it
hold and whether they were routed for owner mode (`KVPPRuntime.note_routing`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpp_fx.backend import kvpp_backend
from kvpp_fx.cache.cost import MODES as KVPP_MODES
from kvpp_fx.cache.cost import LinkModel, RequestRows, StepLoad
from kvpp_fx.cache.placement import KVPPPlan, PoolTooSmallError
from kvpp_fx.reference.config import RefConfig
from kvpp_fx.reference.model import ReferenceModel
from kvpp_fx.reference.ops import REFERENCE_SPECS
from kvpp_fx.runtime.device import resolve_device_api
from kvpp_fx.runtime.runtime import KVPPRuntime

logger = logging.getLogger(__name__)

GRAPH_MODES = ("none", "eager", "piecewise")


class OutOfBlocksError(RuntimeError):
    """The block pool cannot hold the scheduled tokens."""


class RequestTooLongError(ValueError):
    """A request needs more blocks than one compact scratch slot holds; refused when it is added."""


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    token_budget: int = 32
    max_model_len: int = 256
    graph_mode: str = "eager"      # "none" runs the model uncompiled (KVPP off only)
    inner: Any = "eager"           # inner backend of the piecewise mode
    speculative: bool = False      # MTP drafts (needs num_nextn_predict_layers >= 1)
    dump_dir: str | None = None
    active_blocks: bool = True     # pass each step's blocks with history to the runtime (else whole layers)
    kvpp_mode: str = "broadcast"   # "broadcast", "owner" or "auto" (chosen by the cost model)
    per_request_paths: bool = True  # owner/auto: each request's rows take their own path (hybrid steps);
    #                                 False: one path for the whole step
    compact_scratch: bool = True   # scratch slots of S blocks from max_model_len and token_budget (else
    #                                whole layers); a step whose rows do not fit sends some to their owners
    scratch_blocks: int | None = None  # S, overriding what max_model_len and token_budget give
    kvpp_link: LinkModel | None = None  # the cost model's link and owner throughput (default: gloo on one host)
    # "module:callable" building the runtime's DeviceAPI from the cache's device (the tests' fault seam;
    # a string, so that it reaches spawned ranks); None: the default DeviceAPI
    device_api: str | None = None

    def __post_init__(self) -> None:
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {self.graph_mode!r}.")
        if self.kvpp_mode not in KVPP_MODES:
            raise ValueError(f"kvpp_mode must be one of {KVPP_MODES}, got {self.kvpp_mode!r}.")
        if self.block_size < 1 or self.token_budget < 1 or self.max_model_len < self.block_size:
            raise ValueError("block_size and token_budget must be positive and max_model_len >= block_size.")
        if self.compact_scratch and not self.active_blocks:
            raise ValueError("compact_scratch needs active_blocks: a compact slot holds only the listed blocks.")
        if self.scratch_blocks is not None and not self.compact_scratch:
            raise ValueError("scratch_blocks sizes compact slots: it needs compact_scratch=True.")

    @property
    def max_blocks_per_request(self) -> int:
        return -(-self.max_model_len // self.block_size)


class BlockPool:
    """Fixed blocks with reference counts and a prefix cache of full blocks (LRU among free ones)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}

    @staticmethod
    def chain_hashes(tokens: list[int], block_size: int) -> list[int]:
        hashes, h = [], None
        for end in range(block_size, len(tokens) + 1, block_size):
            h = hash((h, tuple(tokens[end - block_size:end])))
            hashes.append(h)
        return hashes

    def match_prefix(self, tokens: list[int]) -> list[int]:
        blocks = []
        for h in self.chain_hashes(tokens, self.block_size):
            block = self.by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take(self, block: int) -> None:
        self.refs[block] += 1
        self.free.pop(block, None)

    def allocate(self) -> int:
        if not self.free:
            raise OutOfBlocksError("the block pool is exhausted; raise num_blocks or lower the load.")
        block, _ = self.free.popitem(last=False)
        old = self.hash_of.pop(block, None)
        if old is not None and self.by_hash.get(old) == block:
            del self.by_hash[old]
        self.refs[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def register(self, block: int, h: int) -> None:
        if h not in self.by_hash:
            self.by_hash[h] = block
            self.hash_of[block] = h


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    admitted: bool = False
    draft: int | None = None
    drafts_proposed: int = 0
    drafts_accepted: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class _Scheduled:
    request: Request
    start: int          # first token position computed this step
    count: int          # tokens computed this step
    draft: int | None   # the draft token among them (last one), if any


@dataclass(frozen=True)
class PipelineLink:
    """Where this rank's stage sends its hidden states, and which rank samples for everyone.

    Every rank runs the same schedule; the sampled token ids travel from ``sampler`` to all ranks.
    """

    prev_rank: int | None
    next_rank: int | None
    sampler: int

    @classmethod
    def for_rank(cls, rank: int, tp: int, pp: int) -> PipelineLink:
        stage = rank // tp
        return cls(prev_rank=rank - tp if stage > 0 else None, next_rank=rank + tp if stage < pp - 1 else None,
                   sampler=(pp - 1) * tp)


class Engine:
    def __init__(self, model: ReferenceModel, runtime: KVPPRuntime, config: EngineConfig,
                 link: PipelineLink | None = None) -> None:
        self.model = model
        self.cfg: RefConfig = model.config
        self.runtime = runtime
        self.config = config
        self.plan: KVPPPlan = runtime.plan
        self.link = link
        self.kvpp_mode = config.kvpp_mode  # may be changed between steps: the graph serves every mode
        if link is not None and config.speculative:
            raise ValueError("speculative decoding is not supported with pipeline parallelism here.")
        if config.graph_mode == "none" and self.plan.enabled:
            raise ValueError("KVPP needs the kvpp backend: use graph_mode 'eager' or 'piecewise'.")
        if config.speculative and not self.cfg.draft_layers:
            raise ValueError("speculative decoding needs a model with num_nextn_predict_layers >= 1.")
        self.pool = BlockPool(runtime.storage.num_blocks, config.block_size)
        self.requests: list[Request] = []
        self.steps: list[dict[str, Any]] = []
        self.last_logits: torch.Tensor | None = None
        self.backend = None
        self._routing_reported = 0  # compile records whose routing the runtime has been told
        components = [c.name for c in self.plan.spec.layer(self.plan.target_layers[0]).components]
        layers = model.layer_ids
        if config.graph_mode == "none":
            self.caches = [tuple(runtime.typed_views(i)[c] for c in components) for i in layers]
            self.forward_fn = model
        else:
            self.caches = [tuple(runtime.handles(i)[c] for c in components) for i in layers]
            self.backend = kvpp_backend(self.plan, mode=config.graph_mode, inner=config.inner,
                                        dump_dir=config.dump_dir, specs=REFERENCE_SPECS)
            self.forward_fn = torch.compile(model, backend=self.backend, fullgraph=True)
        self.draft_cache = [(runtime.typed_views(i)["kv"],) for i in self.cfg.draft_layers if config.speculative]

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: list[int], max_new_tokens: int) -> Request:
        if not prompt:
            raise ValueError("a prompt needs at least one token.")
        if len(prompt) + max_new_tokens + 1 > self.config.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + {max_new_tokens} new tokens exceed max_model_len "
                             f"{self.config.max_model_len}.")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size}).")
        needed = -(-(len(prompt) + max_new_tokens + 1) // self.config.block_size)
        slot = self.runtime.storage.slot_blocks
        if self.plan.enabled and self.plan.compact and needed > slot:
            raise RequestTooLongError(
                f"prompt ({len(prompt)}) + {max_new_tokens} new tokens need {needed} blocks of "
                f"{self.config.block_size} tokens; a scratch slot holds {slot} (scratch_blocks), so at most "
                f"{slot * self.config.block_size - 1} tokens per request.")
        request = Request(len(self.requests), list(prompt), max_new_tokens)
        self.requests.append(request)
        return request

    def _admit(self, request: Request) -> None:
        block_size = self.config.block_size
        hit = self.pool.match_prefix(request.prompt)
        # keep at least one prompt token to compute, so the step yields logits for it
        usable = min(len(hit), (len(request.prompt) - 1) // block_size)
        for block in hit[:usable]:
            self.pool.take(block)
        request.blocks = list(hit[:usable])
        request.num_computed = request.cached_tokens = usable * block_size
        request.admitted = True

    def _ensure_blocks(self, request: Request, upto: int) -> None:
        needed = -(-upto // self.config.block_size)
        while len(request.blocks) < needed:
            request.blocks.append(self.pool.allocate())

    # --- one step -------------------------------------------------------------------------------

    def _schedule(self) -> list[_Scheduled]:
        budget = self.config.token_budget
        batch: list[_Scheduled] = []
        live = [r for r in self.requests if not r.finished]
        for request in (r for r in live if r.admitted and not r.prefilling):
            count = 2 if request.draft is not None else 1
            if count > budget:
                break
            batch.append(_Scheduled(request, request.num_computed, count, request.draft))
            budget -= count
        # One request prefills at a time, first come first served: a later prompt is admitted only once
        # the earlier ones are fully computed, so it can reuse their cached prefix blocks.
        waiting = next((r for r in live if not r.admitted or r.prefilling), None)
        if waiting is not None and budget > 0:
            if not waiting.admitted:
                self._admit(waiting)
            count = min(len(waiting.prompt) - waiting.num_computed, budget)
            batch.append(_Scheduled(waiting, waiting.num_computed, count, None))
        return batch

    def _inputs(self, batch: list[_Scheduled]) -> dict[str, torch.Tensor]:
        block_size = self.config.block_size
        ids, positions, slots, logits_at = [], [], [], []
        table = torch.zeros(len(batch), self.config.max_blocks_per_request, dtype=torch.int32)
        for row, item in enumerate(batch):
            request = item.request
            end = item.start + item.count
            self._ensure_blocks(request, end)
            tokens = request.tokens + ([item.draft] if item.draft is not None else [])
            for pos in range(item.start, end):
                ids.append(tokens[pos])
                positions.append(pos)
                slots.append(request.blocks[pos // block_size] * block_size + pos % block_size)
            first = len(ids) - item.count
            logits_at.extend(range(first, len(ids)) if item.draft is not None else [len(ids) - 1])
            table[row, : len(request.blocks)] = torch.tensor(request.blocks, dtype=torch.int32)
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "positions": torch.tensor(positions, dtype=torch.long),
            "slot_mapping": torch.tensor(slots, dtype=torch.long),
            "block_table": table,
            "seq_lens": torch.tensor([i.start + i.count for i in batch], dtype=torch.long),
            "query_lens": torch.tensor([i.count for i in batch], dtype=torch.long),
            "logits_indices": torch.tensor(logits_at, dtype=torch.long),
        }

    def active_blocks(self, batch: list[_Scheduled]) -> list[int]:
        """The blocks this step reads that hold tokens computed before it: for every scheduled request,
        the block-table entries covering its computed tokens (prefix-cache hits included)."""
        block_size = self.config.block_size
        blocks: set[int] = set()
        for item in batch:
            blocks.update(item.request.blocks[: -(-item.start // block_size)])
        return sorted(blocks)

    def load(self, batch: list[_Scheduled]) -> StepLoad:
        """The step's query tokens and the (query, context token) pairs its attention scores."""
        return StepLoad(sum(item.count for item in batch), sum(self._pairs(item) for item in batch))

    def _pairs(self, item: _Scheduled) -> int:
        topk = self.cfg.index_topk
        return sum(min(position + 1, topk) if topk is not None else position + 1
                   for position in range(item.start, item.start + item.count))

    def written_blocks(self, batch: list[_Scheduled]) -> list[int]:
        """The blocks this step writes that hold no token computed before it."""
        return sorted({b for item in batch for b in self._written(item)})

    def _written(self, item: _Scheduled) -> list[int]:
        block_size = self.config.block_size
        return item.request.blocks[-(-item.start // block_size): -(-(item.start + item.count) // block_size)]

    def request_rows(self, batch: list[_Scheduled]) -> tuple[RequestRows, ...]:
        """Each scheduled request's rows, the blocks with history it reads and the blocks it fills, in
        batch order (the order of the rows of the step's block table): the runtime gives each its path."""
        block_size = self.config.block_size
        return tuple(RequestRows(item.count, self._pairs(item), tuple(item.request.blocks[: -(-item.start // block_size)]),
                                 written=tuple(self._written(item)))
                     for item in batch)

    def _run_target(self, inputs: dict[str, torch.Tensor], has_history: bool, blocks: list[int] | None = None,
                    load: StepLoad | None = None, requests: tuple[RequestRows, ...] | None = None,
                    written: list[int] | None = None):
        hidden_in = None
        if self.link is not None and self.link.prev_rank is not None:
            hidden_in = torch.empty(inputs["input_ids"].numel(), self.cfg.hidden_size)
            torch.distributed.recv(hidden_in, src=self.link.prev_rank)
        args = (inputs["input_ids"], inputs["positions"], self.caches, inputs["slot_mapping"],
                inputs["block_table"], inputs["seq_lens"], inputs["query_lens"], inputs["logits_indices"],
                hidden_in)
        if self.config.graph_mode == "none":
            logits, hidden = self.forward_fn(*args)
        else:
            try:
                if requests is not None:  # each request's rows take their own path
                    forward = self.runtime.forward(has_history, mode=self.kvpp_mode, requests=requests)
                else:
                    forward = self.runtime.forward(has_history, blocks=blocks, written=written, mode=self.kvpp_mode,
                                                   load=load)
                with forward:
                    logits, hidden = self.forward_fn(*args)
            finally:  # a step that raised may still have compiled
                self._report_routing()
        if self.link is not None and self.link.next_rank is not None:
            torch.distributed.send(hidden.contiguous(), dst=self.link.next_rank)
        return logits, hidden

    def _report_routing(self) -> None:
        """Tell the runtime which layers the graphs compiled since the last step hold and whether they
        were routed for owner mode: ``"auto"`` chooses owner mode only once every layer is known to be
        routed, and owner mode is refused up front for a layer known not to be."""
        records = self.backend.records
        for record in records[self._routing_reported:]:
            self.runtime.note_routing(*record.routed_layers(self.plan.target_layers))
        self._routing_reported = len(records)

    def _sample(self, logits: torch.Tensor | None, count: int) -> list[int]:
        """Greedy token ids; under pipeline parallelism the last stage's are broadcast to every rank."""
        if self.link is None:
            return logits.argmax(dim=-1).tolist()
        ids = logits.argmax(dim=-1) if logits is not None else torch.empty(count, dtype=torch.long)
        torch.distributed.broadcast(ids, src=self.link.sampler)
        return ids.tolist()

    def step(self) -> dict[str, Any]:
        batch = self._schedule()
        if not batch:
            return {}
        has_history = any(item.request.num_computed > 0 for item in batch)
        decode_only = all(item.start >= len(item.request.prompt) for item in batch)
        inputs = self._inputs(batch)
        blocks = self.active_blocks(batch) if self.config.active_blocks else None
        written = self.written_blocks(batch) if blocks is not None else None
        # owner and auto: per request (hybrid steps); compact slots too, so that rows that do not fit in
        # a slot go to their owners; broadcast, or whole layers: one path for the step
        per_request = self.kvpp_mode != "broadcast" or (self.plan.enabled and self.plan.compact)
        requests = (self.request_rows(batch) if per_request and blocks is not None
                    and self.config.per_request_paths else None)
        start = time.perf_counter()
        with torch.no_grad():
            logits, hidden = self._run_target(inputs, has_history, blocks, self.load(batch), requests, written)
        elapsed = time.perf_counter() - start
        self.last_logits = logits
        sampled = self._sample(logits, int(inputs["logits_indices"].numel()))
        accepted_spans = self._accept(batch, sampled)
        if self.config.speculative:
            with torch.no_grad():
                self._propose(batch, accepted_spans, hidden)
        moved = self.runtime.last_forward() if self.config.graph_mode != "none" else None
        record = {"has_history": has_history, "num_tokens": int(inputs["input_ids"].numel()),
                  "requests": [(i.request.rid, i.start, i.count) for i in batch], "seconds": elapsed,
                  "decode_only": decode_only,
                  "mode": moved["mode"] if moved and self.plan.enabled else None,
                  "broadcast_bytes": moved["broadcast_bytes"] if moved else 0,
                  "broadcasts": moved["broadcasts"] if moved else 0,
                  "owner_bytes": moved["exchange_bytes"] if moved else 0,
                  "paths": moved["choice"]["modes"] if moved and moved["rows"] is not None else None,
                  "exchanges": moved["exchanges"] if moved else 0,
                  "active_blocks": len(blocks) if blocks is not None else None,
                  "pool_blocks": len(self.pool.refs)}
        self.steps.append(record)
        return record

    def _accept(self, batch: list[_Scheduled], sampled: list[int]) -> list[tuple[int, int]]:
        """Apply greedy results; return each request's accepted (start, count) positions."""
        spans, cursor = [], 0
        for item in batch:
            request = item.request
            if item.draft is not None:
                first, bonus = sampled[cursor], sampled[cursor + 1]
                cursor += 2
                request.drafts_proposed += 1
                if first == item.draft:
                    request.drafts_accepted += 1
                    request.output += [first, bonus]
                    accepted = 2
                else:
                    request.output.append(first)
                    accepted = 1
            else:
                token = sampled[cursor]
                cursor += 1
                accepted = item.count
                if item.start + item.count >= len(request.prompt):
                    request.output.append(token)
            request.draft = None
            request.num_computed = item.start + accepted
            del request.output[request.max_new_tokens:]
            spans.append((item.start, accepted))
            self._register_blocks(request)
            if request.finished:
                self.pool.release(request.blocks)
        return spans

    def _register_blocks(self, request: Request) -> None:
        tokens = request.tokens[: request.num_computed]
        for i, h in enumerate(BlockPool.chain_hashes(tokens, self.config.block_size)):
            self.pool.register(request.blocks[i], h)

    def _propose(self, batch: list[_Scheduled], spans: list[tuple[int, int]], hidden: torch.Tensor) -> None:
        """Run the MTP layer over the newly accepted positions; the last one's argmax is the next draft."""
        block_size = self.config.block_size
        rows, ids, positions, slots, hidden_rows, logits_at, items = [], [], [], [], [], [], []
        offset = 0
        for item, (start, accepted) in zip(batch, spans):
            request = item.request
            tokens = request.tokens
            take = [p for p in range(start, start + accepted) if p + 1 < len(tokens)]
            if take and not request.finished:
                rows.append((item, take))
                for p in take:
                    ids.append(tokens[p + 1])
                    positions.append(p)
                    slots.append(request.blocks[p // block_size] * block_size + p % block_size)
                    hidden_rows.append(offset + (p - item.start))
                logits_at.append(len(ids) - 1)
                items.append(item)
            offset += item.count
        if not rows:
            return
        table = torch.zeros(len(rows), self.config.max_blocks_per_request, dtype=torch.int32)
        for r, (item, _) in enumerate(rows):
            table[r, : len(item.request.blocks)] = torch.tensor(item.request.blocks, dtype=torch.int32)
        logits = self.model.propose(
            torch.tensor(ids), hidden[torch.tensor(hidden_rows)], torch.tensor(positions), self.draft_cache[0],
            torch.tensor(slots), table, torch.tensor([take[-1] + 1 for _, take in rows]),
            torch.tensor([len(take) for _, take in rows]), torch.tensor(logits_at))
        for (item, take), token in zip(rows, logits.argmax(dim=-1).tolist()):
            request = item.request
            if not request.prefilling and take[-1] + 1 == len(request.tokens) - 1:
                request.draft = token

    def run(self, max_steps: int = 10_000) -> list[list[int]]:
        for _ in range(max_steps):
            if all(r.finished for r in self.requests):
                break
            self.step()
        else:
            raise RuntimeError(f"requests did not finish within {max_steps} steps.")
        return [r.output for r in self.requests]


def build_engine(config: RefConfig, *, engine_config: EngineConfig, num_blocks: int | None = None,
                 kv_memory: int | None = None, kvpp: bool = False, tp=None, kvpp_group=None, checkpoint=None,
                 pp=None, link: PipelineLink | None = None, timeline=None) -> Engine:
    """Model + cache + runtime + driver for one rank. With ``kvpp=False`` the plan has a group of one,
    so every layer is persistent on this rank (the replicated cache) and the runtime moves nothing.

    The cache holds ``num_blocks`` blocks, or as many as fit in ``kv_memory`` bytes (give one of them).
    """
    if (num_blocks is None) == (kv_memory is None):
        raise ValueError("give build_engine either num_blocks or kv_memory.")
    from kvpp_fx.cache.allocate import allocate_cache
    from kvpp_fx.reference.model import TPInfo
    from kvpp_fx.reference.weights import build_model

    tp = tp or TPInfo()
    model = build_model(config, tp, checkpoint, pp=pp)
    spec = config.cache_spec(engine_config.block_size)
    stage_layers = model.layer_ids + (config.draft_layers if engine_config.speculative else ())
    group_size = tp.size if kvpp else 1
    plan = KVPPPlan(spec, group_size=group_size, layers=stage_layers)
    if engine_config.compact_scratch and group_size > 1:
        compact = KVPPPlan.for_requests(spec, group_size, max_model_len=engine_config.max_model_len,
                                        token_budget=engine_config.token_budget,
                                        scratch_blocks=engine_config.scratch_blocks, layers=stage_layers)
        pool = num_blocks if num_blocks is not None else compact.num_blocks(kv_memory)
        try:
            compact.check_pool(pool)
            plan = compact
        except PoolTooSmallError:
            # A pool that holds no two max-length requests gains nothing from compact slots; an explicit
            # scratch_blocks must fit, though.
            if engine_config.scratch_blocks is not None:
                raise
    if kvpp and plan.enabled and kvpp_group is None:
        raise ValueError("KVPP with a group larger than one needs its process group.")
    group = kvpp_group if plan.enabled else None
    rank = torch.distributed.get_rank(group) if group is not None else 0
    storage = allocate_cache(plan, rank, num_blocks if num_blocks is not None else plan.num_blocks(kv_memory))
    device_api = resolve_device_api(engine_config.device_api, storage.device) if engine_config.device_api else None
    runtime = KVPPRuntime.create(plan, storage, group, timeline=timeline, device_api=device_api,
                                 attention=config.attention_shape() if plan.enabled else None,
                                 link=engine_config.kvpp_link)
    return Engine(model, runtime, engine_config, link)
