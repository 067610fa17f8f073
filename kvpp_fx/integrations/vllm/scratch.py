"""Compact scratch slots in vLLM: where a slot of S blocks holds every step, and which layout holds more.

A compact slot (`KVPPPlan.scratch_blocks`) holds S blocks: those of a request of ``max_model_len``
tokens plus those a full budget of ``max_num_batched_tokens`` fills (`scratch_blocks_for`), or
``additional_config.kvpp_scratch_blocks``. A step whose broadcast set is wider sends rows to their
owners (`cost.fit_rows`), and only decode rows can go there (`owner_rows`). So a compact slot holds
every step only where each row that reads history is a decode row its owner can run:

- the attention backend runs decode rows on the owner (`owner_rows.why_not_owner_capable`);
- no prefill row reads history: neither chunked prefill (later chunks) nor prefix caching (hits);
- no speculative decoding: its verification rows reach vLLM CPU's decode kernel as prefill rows
  with history (one query per request there);
- no ``long_prefill_token_threshold`` (it splits long prompts even without chunked prefill) and no KV
  connector (external tokens arrive as history);
- no micro-batched (DBO) steps, whose per-micro-batch metadata KVPP does not remap.

Prefill rows without history take no slot positions (`owner_rows.step_requests`), so a budget of
fresh prompts packs nothing, however many requests share it. One source of prefill history stays
outside what the configuration shows: a resumed streaming-input session (``AsyncLLM.generate`` with an
async-generator prompt). Such a step still broadcasts its history, and one wider than a slot is
refused on every rank before anything moves (`ScratchOverflowError`).

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

from kvpp_fx.cache.placement import PoolTooSmallError, scratch_blocks_for
from kvpp_fx.integrations.vllm.config import KVPPConfig, model_kind_of


class ScratchLayoutError(ValueError):
    """``additional_config.kvpp_scratch_blocks`` cannot be honoured by this engine."""


def config_blocker(vllm_config: Any) -> str | None:
    """Why, from the configuration alone, a step here may read more history than it can shed to owners."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    kind = model_kind_of(getattr(vllm_config, "model_config", None))
    if kind != "mla":
        return f"the model is {kind.upper()}: its decode rows do not go to the owner"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return ("speculative decoding is on: its verification rows read their history as prefill rows, which "
                "never go to the owner")
    if getattr(scheduler, "enable_chunked_prefill", False):
        return "chunked prefill is on: a later chunk reads its history as a prefill row, which never goes to the owner"
    if getattr(scheduler, "long_prefill_token_threshold", 0):
        return ("long_prefill_token_threshold is set: a long prompt's later part reads its history as a prefill row, "
                "which never goes to the owner")
    if getattr(cache, "enable_prefix_caching", False):
        return "prefix caching is on: a prefix hit is a prefill row's history, which never goes to the owner"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        return "a KV connector is set: its external tokens are a prefill row's history, and it reads whole pools"
    if getattr(parallel, "use_ubatching", False):
        return "micro-batching (DBO) is on: its per-micro-batch metadata is not remapped to packed slots"
    return None


def compact_blocker(vllm_config: Any, owner_blocker: str | None) -> str | None:
    """Why compact slots cannot run on this engine (`owner_blocker`: why its decode rows cannot go to
    the owner), or None."""
    if owner_blocker is not None:
        return f"decode rows cannot go to their owners ({owner_blocker})"
    return config_blocker(vllm_config)


def refusal(why: str) -> str:
    return (f"additional_config.kvpp_scratch_blocks cannot run here: {why}, so a step could read more blocks "
            "than a compact slot holds. Remove kvpp_scratch_blocks (KVPP then keeps whole-layer slots).")


def request_blocks(vllm_config: Any, block_size: int) -> int:
    """The blocks of one request of ``max_model_len`` tokens."""
    return -(-int(vllm_config.model_config.max_model_len) // block_size)


def slot_blocks(vllm_config: Any, config: KVPPConfig, block_size: int) -> int:
    """S: the explicit ``kvpp_scratch_blocks``, else the blocks of a max-length request plus those of a
    full token budget."""
    if config.scratch_blocks is not None:
        return config.scratch_blocks
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
