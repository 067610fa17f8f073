"""Compact scratch slots in vLLM: where a slot of S blocks holds every step, and which layout holds more.

A compact slot (`KVPPPlan.scratch_blocks`) holds S blocks: those of a request of ``max_model_len``
tokens plus those a full budget of ``max_num_batched_tokens`` fills (`scratch_blocks_for`), or
``additional_config.kvpp_scratch_blocks``. What a step puts there: the history of its decode rows that
read by broadcast, and the blocks those rows write. A step whose decode rows read more sends them to
their owners (`cost.fit_rows`, `owner_rows`). A prefill row's history never takes a slot position: its
layer's owner streams each chunk of it into vLLM's context workspace (`context_stream`), whether the
history is a later chunk (chunked prefill, ``long_prefill_token_threshold``), a prefix-cache hit, a
speculative verification row that the backend runs as a prefill row (CPU_MLA), or a resumed
streaming-input session. So a compact slot holds every step where:

- the attention backend runs decode rows on the owner (`owner_rows.why_not_owner_capable`);
- its MLA impl reads prefill history through vLLM's chunked context (`context_stream.hook_impl`);
  elsewhere the older rule holds: no prefill row may read history (no chunked prefill, prefix caching,
  ``long_prefill_token_threshold`` nor speculative decoding);
- no KV connector: it saves and loads whole pools, and its external tokens are history no owner has;
- no micro-batched (DBO) steps, whose per-micro-batch metadata KVPP does not remap.

Prefill rows take no slot positions (`owner_rows.step_requests`): a budget of prompts packs nothing,
however many requests share it, and a step's packed list is its broadcast decode rows' alone.

An SFA model's compact slots are owner-only (`owner_only`): its sparse and indexer metadata are not
remapped to packed slots, so no step reads a slot, and every row of every step, first prefills included,
goes to its layer's owner (`step.whole_layer_rows`; the sparse backend is declared to route every token as
a decode row). A slot of `OWNER_ONLY_SLOT_BLOCKS` then stands in for the layers a rank does not hold. It
keeps whole-layer slots where the engine starts in broadcast mode, where a non-owner would write a cache
that KVPP cannot skip (compiled pieces, breakable CUDA graphs, an attention with a forward of its own:
`model_hooks.owner_only_hazard`), and with a KV connector or micro-batching.

Elsewhere vLLM keeps whole-layer slots, and an explicit ``kvpp_scratch_blocks`` is refused naming
the reason. Where compact slots can run, the worker takes whichever layout holds more blocks in its
budget (`choose_plan`): S includes the token budget, so on a small pool whole-layer slots can win.

Invariants:
- Every rank of a group takes the same layout: each chooses from the group's smallest budget, and
  the choice is checked across the group when the cache is allocated (`KVPPAllocationError`
  otherwise), before any step runs.
- An explicit S holds a request of ``max_model_len`` tokens, or the engine is refused at construction.
"""

from __future__ import annotations

from typing import Any

from kvpp_fx.cache.cost import AUTO, BROADCAST
from kvpp_fx.cache.placement import PoolTooSmallError, scratch_blocks_for
from kvpp_fx.integrations.vllm.setup.config import KVPPConfig, model_kind_of


class ScratchLayoutError(ValueError):
    """``additional_config.kvpp_scratch_blocks`` cannot be honoured by this engine."""


def config_blocker(vllm_config: Any, streams_history: bool = True) -> str | None:
    """Why, from the configuration alone, a step here may read more history than it can shed to owners
    (`streams_history`: whether prefill history streams from the owners instead of a slot)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    kind = model_kind_of(getattr(vllm_config, "model_config", None))
    if kind == "sfa":
        return ("the model is SFA: vLLM's sparse and indexer metadata hold block tables KVPP does not remap to "
                "packed slots")
    if kind != "mla":
        return f"the model is {kind.upper()}: its decode rows do not go to the owner"
    if not streams_history:
        why = _prefill_history(vllm_config, scheduler, cache)
        if why is not None:
            return (f"{why}, and this attention backend reads prefill history only from its cache (not through "
                    "vLLM's chunked context, which KVPP streams from the owners)")
    return _engine_blocker(vllm_config)


def _engine_blocker(vllm_config: Any) -> str | None:
    """A setting under which a step reads pools or metadata that no slot layout serves, or None."""
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "a KV connector is set: its external tokens are a prefill row's history, and it reads whole pools"
    if getattr(getattr(vllm_config, "parallel_config", None), "use_ubatching", False):
        return "micro-batching (DBO) is on: its per-micro-batch metadata is not remapped to packed slots"
    return None


def _prefill_history(vllm_config: Any, scheduler: Any, cache: Any) -> str | None:
    """Which setting lets a prefill row read history, or None."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding is on: its verification rows may read their history as prefill rows"
    if getattr(scheduler, "enable_chunked_prefill", False):
        return "chunked prefill is on: a later chunk reads its history as a prefill row"
    if getattr(scheduler, "long_prefill_token_threshold", 0):
        return "long_prefill_token_threshold is set: a long prompt's later part reads its history as a prefill row"
    if getattr(cache, "enable_prefix_caching", False):
        return "prefix caching is on: a prefix hit is a prefill row's history"
    return None


def compact_blocker(vllm_config: Any, owner_blocker: str | None, streams_history: bool,
                    mode: str = AUTO, owner_only_hazard: str | None = None) -> str | None:
    """Why compact slots cannot run on this engine (`owner_blocker`: why its decode rows cannot go to
    the owner; `streams_history`: whether its prefill history streams from the owners; `mode`: the engine's
    mode at start; `owner_only_hazard`: why the loaded model's attention could not run on owner-only slots,
    `model_hooks.owner_only_hazard`), or None. An SFA model's slots are owner-only (`owner_only`) where they
    are compact."""
    if owner_blocker is not None:
        return f"decode rows cannot go to their owners ({owner_blocker})"
    if owner_only(vllm_config):
        return owner_only_blocker(vllm_config, mode, owner_only_hazard)
    return config_blocker(vllm_config, streams_history)


def owner_only(vllm_config: Any) -> bool:
    """Whether compact slots here are owner-only: an SFA model, whose sparse and indexer metadata KVPP does
    not remap, so no step reads a slot; every row of every step goes to its layer's owner instead."""
    return model_kind_of(getattr(vllm_config, "model_config", None)) == "sfa"


def owner_only_blocker(vllm_config: Any, mode: str, hazard: str | None = None) -> str | None:
    """Why an SFA model keeps whole-layer slots: broadcast mode asked at start, what its attention does
    (`hazard`: a backend that may split prefill rows, a cache write KVPP cannot skip on a non-owner), an indexer
    inside a compiled piece (whose key write would land in a slot that holds no layer), or a setting under
    which a step's rows cannot all go to the owners."""
    if mode == BROADCAST:
        return ("kvpp_mode is 'broadcast' at start: an SFA model's steps then broadcast whole layers (its sparse "
                "and indexer metadata are not remapped to packed slots)")
    if hazard is not None:
        return hazard
    compile_mode = int(getattr(getattr(vllm_config, "compilation_config", None), "mode", 0) or 0)
    if compile_mode != 0:
        return (f"compile mode {compile_mode}: the indexer runs inside compiled pieces on every rank, and its key "
                "write, which KVPP skips only in eager forwards, would land in a slot that holds no layer")
    return _engine_blocker(vllm_config)


def refusal(why: str) -> str:
    return (f"additional_config.kvpp_scratch_blocks cannot run here: {why}, so a step could read more blocks "
            "than a compact slot holds. Remove kvpp_scratch_blocks (KVPP then keeps whole-layer slots).")


OWNER_ONLY_SLOT_BLOCKS = 1  # the smallest slot a plan has: an owner-only slot is never read


def request_blocks(vllm_config: Any, block_size: int) -> int:
    """The blocks of one request of ``max_model_len`` tokens."""
    return -(-int(vllm_config.model_config.max_model_len) // block_size)


def slot_blocks(vllm_config: Any, config: KVPPConfig, block_size: int) -> int:
    """S: the explicit ``kvpp_scratch_blocks``, else `OWNER_ONLY_SLOT_BLOCKS` for owner-only slots, else the
    blocks of a max-length request plus those of a full token budget."""
    if config.scratch_blocks is not None:
        return config.scratch_blocks
    if owner_only(vllm_config):
        return OWNER_ONLY_SLOT_BLOCKS
    return scratch_blocks_for(int(vllm_config.model_config.max_model_len),
                              int(vllm_config.scheduler_config.max_num_batched_tokens), block_size)


def check_explicit(vllm_config: Any, config: KVPPConfig) -> None:
    """At construction: an explicit S runs on this configuration and holds a max-length request."""
    if not config.enabled or config.scratch_blocks is None:
        return
    why = config_blocker(vllm_config)
    if why is not None:
        raise ScratchLayoutError(refusal(why))
    block_size = int(vllm_config.cache_config.block_size)
    needed = request_blocks(vllm_config, block_size)
    if config.scratch_blocks < needed:
        raise ScratchLayoutError(
            f"additional_config.kvpp_scratch_blocks={config.scratch_blocks} holds fewer blocks than one request of "
            f"max_model_len={vllm_config.model_config.max_model_len} tokens needs ({needed} blocks of {block_size} "
            f"tokens); set it to at least {needed}, or lower max_model_len.")


def choose_plan(compact: Any, whole: Any, available_bytes: int, explicit: bool) -> tuple[Any, str]:
    """The layout this worker allocates (a `specs.VllmPlan`) and why: compact slots where they fit the
    pool and hold more blocks than whole-layer ones; an explicit S must fit (`PoolTooSmallError`)."""
    blocks = compact.plan.num_blocks(available_bytes)
    try:
        compact.plan.check_pool(blocks)
    except PoolTooSmallError as exc:
        if explicit:
            raise ScratchLayoutError(f"additional_config.kvpp_scratch_blocks={compact.plan.scratch_blocks}: "
                                     f"{exc}") from None
        return whole, f"compact slots do not fit this pool ({exc})"
    whole_blocks = whole.plan.num_blocks(available_bytes)
    if explicit or blocks > whole_blocks:
        return compact, (f"compact slots of {compact.plan.scratch_blocks} blocks: {blocks} blocks per rank "
                         f"(whole-layer slots: {whole_blocks})")
    return whole, (f"whole-layer slots hold {whole_blocks} blocks per rank, compact slots of "
                   f"{compact.plan.scratch_blocks} blocks {blocks}")
