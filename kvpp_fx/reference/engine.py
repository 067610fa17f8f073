"""The reference engine: a small step driver for the reference model (readable, not a serving engine),
and `build_engine`, which assembles model, cache, runtime and driver for one rank.

Each step schedules chunks (`scheduling`: decodes, then one prefill chunk under the token budget), builds
the model's inputs (`step_inputs`), runs the model, samples greedily and advances the requests.

The same driver runs with KVPP on or off: the only difference is the plan's group size (N or 1).
Either way the model's caches are owned by a `KVPPRuntime`, and each step with a compiled model runs
under ``runtime.forward(has_history)`` with ``has_history = any(num_computed_tokens > 0)`` over the
scheduled requests, as the reference implementation computes it; in owner and auto mode the forward
names each request's rows and blocks (``requests=``, from `step_paths`), so a step of decodes next to a
prefill chunk can send the decodes to the owners and broadcast the chunk's history (a hybrid step). The
engine owns both the backend and the runtime, so it is what tells the runtime, after each step, which
layers the graphs compiled in it hold and whether they were routed for owner mode
(`KVPPRuntime.note_routing`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvpp_fx.backend import kvpp_backend
from kvpp_fx.cache.cost import RequestRows, StepLoad
from kvpp_fx.cache.placement import KVPPPlan, PoolTooSmallError
from kvpp_fx.reference import step_paths
from kvpp_fx.reference.block_pool import BlockPool, OutOfBlocksError
from kvpp_fx.reference.config import RefConfig
from kvpp_fx.reference.engine_config import GRAPH_MODES, EngineConfig, PipelineLink
from kvpp_fx.reference.model import ReferenceModel
from kvpp_fx.reference.ops import REFERENCE_SPECS
from kvpp_fx.reference.scheduling import Request, ScheduledChunk, accept, ensure_blocks, schedule
from kvpp_fx.reference.step_inputs import draft_inputs, target_inputs
from kvpp_fx.runtime.device import resolve_device_api
from kvpp_fx.runtime.runtime import KVPPRuntime

__all__ = ["GRAPH_MODES", "BlockPool", "Engine", "EngineConfig", "OutOfBlocksError", "PipelineLink", "Request",
           "RequestTooLongError", "build_engine"]

logger = logging.getLogger(__name__)


class RequestTooLongError(ValueError):
    """A request needs more blocks than one compact scratch slot holds; refused when it is added."""


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

    # --- one step -------------------------------------------------------------------------------

    def _inputs(self, batch: list[ScheduledChunk]) -> dict[str, torch.Tensor]:
        for item in batch:
            ensure_blocks(item.request, item.start + item.count, self.pool)
        return target_inputs(batch, self.config.block_size, self.config.max_blocks_per_request)

    def active_blocks(self, batch: list[ScheduledChunk]) -> list[int]:
        return step_paths.active_blocks(batch, self.config.block_size)

    def load(self, batch: list[ScheduledChunk]) -> StepLoad:
        return step_paths.step_load(batch, self.cfg.index_topk)

    def written_blocks(self, batch: list[ScheduledChunk]) -> list[int]:
        return step_paths.written_blocks(batch, self.config.block_size)

    def request_rows(self, batch: list[ScheduledChunk]) -> tuple[RequestRows, ...]:
        return step_paths.request_rows(batch, self.config.block_size, self.cfg.index_topk)

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
        batch = schedule(self.requests, self.pool, self.config.token_budget)
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
        accepted_spans = accept(batch, sampled, self.pool)
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

    def _propose(self, batch: list[ScheduledChunk], spans: list[tuple[int, int]], hidden: torch.Tensor) -> None:
        """Run the MTP layer over the newly accepted positions; the last one's argmax is the next draft."""
        draft = draft_inputs(batch, spans, self.config.block_size, self.config.max_blocks_per_request)
        if draft is None:
            return
        logits = self.model.propose(
            draft.input_ids, hidden[draft.hidden_rows], draft.positions, self.draft_cache[0], draft.slot_mapping,
            draft.block_table, draft.seq_lens, draft.query_lens, draft.logits_indices)
        for (item, take), token in zip(draft.rows, logits.argmax(dim=-1).tolist()):
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
