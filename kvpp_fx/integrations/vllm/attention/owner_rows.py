"""Owner mode for vLLM's MLA decode rows, below the graph, and the step's requests as the runtime sees them.

vLLM's MLA op (``unified_mla_attention_with_output``, or ``MLAAttention.forward`` in eager mode) runs
``MLAAttention.forward_impl``: the first ``num_decode_tokens`` rows are decode rows; their queries are
absorbed with this rank's ``W_UK_T`` into ``[T, h, kv_lora_rank + rope]``, ``impl.forward_mqa`` attends
over the cache and returns ``[T, h, kv_lora_rank]``, and this rank's ``W_UV`` makes the output. The op
runs eagerly in every vLLM mode (a splitting op in mode 3, an eager piece in mode 2, an eager break
under breakable CUDA graphs), so an exchange placed in ``forward_mqa`` serves every mode with no graph
change; the op's spec declares `RoutesItself`.

In a forward whose decode rows go to the owner (the layer's turn's `rows_to_owner`), each target layer's
``forward_mqa`` sends this rank's absorbed queries to the layer's owner (its turn's `owner_compute`);
the owner concatenates every rank's heads in rank order, runs the backend's own ``forward_mqa`` for
all heads against its persistent cache with the step's metadata, and returns each rank the latent of
its heads; every rank then applies its own ``W_UV``. In a forward whose every row goes to the owner,
the non-owners skip the layer's cache write: nothing in it reads their copy. A hybrid forward writes on
every rank, since a prefill row may read a block that this step's rows fill (a same-step prefix hit).

Bytes per layer and decode step, T decode tokens, H heads over N ranks, s bytes per value: each
non-owner sends ``T x H/N x (kv_lora_rank + rope) x s`` and receives ``T x H/N x kv_lora_rank x s``
(plus one status value); the owner's link carries N - 1 times that. None of it depends on the context.

Which steps and rows: `step_requests` reads the step's MLA metadata: the decode rows are one request
group (one kernel call serves them, so they take one path together), each prefill request one more,
never owner-capable. The runtime's cost model (``kvpp_mode="auto"``) or the configured mode picks.

Which backends can run an owner call, and what KVPP does for each (its own metadata for the call, a
kernel call per rank's heads where the workspace is sized for them, a padded query) is `backends`;
elsewhere "auto" broadcasts and "owner" is refused when the model loads.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from kvpp_fx.cache.block_ids import EMPTY
from kvpp_fx.cache.cost import AttentionShape, LinkModel, RequestRows
from kvpp_fx.integrations.vllm.attention.backends import before_owner_call, owner_blocker, owner_call
from kvpp_fx.integrations.vllm.engine.batch import StepBatch, history_blocks, written_blocks
from kvpp_fx.integrations.vllm.engine.state import open_turn
from kvpp_fx.runtime.owner_exchange import HeadRule

# The cost model's link per platform. CPU: measured on the bench (gloo, 2 processes, 2 cores). CUDA
# and NPU: estimates, not measured here (NVLink at about half its peak per rank; HCCS likewise).
DEFAULT_LINKS: Mapping[str, LinkModel] = {
    "cpu": LinkModel(),
    "cuda": LinkModel(bytes_per_s=150e9, latency_s=20e-6, attention_flops_per_s=200e12),  # estimate
    "npu": LinkModel(bytes_per_s=50e9, latency_s=30e-6, attention_flops_per_s=100e12),  # estimate
}


class OwnerRowsUnsupportedError(RuntimeError):
    """``kvpp_mode="owner"`` was asked where vLLM's decode rows cannot run on the owner."""


# ``forward_mqa``'s heads: one head operand, the query ``[T, h, L + R]``, heads on dimension 1; the output
# ``[T, h, L]`` (given to the exchange as a template), heads on dimension 1.
MQA_RULE = HeadRule(heads=((0, 1),), token_dims=(0,), output_dim=1, output_like=0)


def attention_shape(model_config: Any) -> AttentionShape:
    """What an owner-mode decode row ships per head: the absorbed query and the latent output."""
    hf = model_config.hf_text_config
    itemsize = torch.empty((), dtype=model_config.dtype).element_size()
    return AttentionShape(int(hf.num_attention_heads), int(hf.kv_lora_rank) + int(hf.qk_rope_head_dim),
                          int(hf.kv_lora_rank), itemsize)


def why_not_owner_capable(backends: set[str], model_kind: str, pcp: int) -> str | None:
    """Why this engine's decode rows cannot go to the owner, or None when they can (`backends.owner_blocker`
    for each attention backend)."""
    if model_kind not in ("mla", "sfa"):
        return f"the model is {model_kind.upper()}: only MLA decode rows are exchanged"
    if pcp != 1:
        return "prefill context parallelism splits the KVPP group beyond the heads' TP split"
    for backend in sorted(backends):
        why = owner_blocker(backend, sparse=model_kind == "sfa")
        if why is not None:
            return f"the model is SFA: {why}" if model_kind == "sfa" else why
    return None


def shared_topk_blocker(attention_layers: set[int], indexed_layers: set[int]) -> str | None:
    """Why an SFA model's rows cannot go to their owners when some attention layers have no indexer of their own
    (vLLM's IndexCache: ``index_topk_freq`` > 1 or an ``index_topk_pattern`` with "S"): such a layer reads the
    top-k an earlier layer's indexer left in the model's one buffer, which a non-owner of that earlier layer
    never fills. None when every layer has its indexer."""
    shared = sorted(attention_layers - indexed_layers)
    if not shared:
        return None
    return (f"the model is SFA and layers {shared} reuse an earlier layer's top-k (IndexCache: index_topk_freq or "
            "index_topk_pattern), which a rank that does not own that earlier layer never computes")


def step_requests(attn_metadata: Any, layer_name: str, batch: StepBatch, owner_capable: bool,
                  streams_history: bool = False) -> tuple[tuple[RequestRows, ...], int] | None:
    """The step's requests for `KVPPRuntime.forward(requests=...)`: the decode rows (the first
    ``num_decodes`` requests of the layer's MLA metadata) as one group, then each prefill request; and
    the number of decode requests. None when the step has no MLA metadata for the layer.

    ``streams_history``: the prefill rows' history streams from the owners (`context_stream`), so a
    prefill row lists no block at all."""
    metadata = attn_metadata
    if isinstance(metadata, list):  # micro-batches (DBO): their rows are not the batch's; broadcast instead
        return None
    if isinstance(metadata, dict):
        metadata = metadata.get(layer_name)
    if metadata is None or getattr(metadata, "num_decodes", None) is None:
        return None
    num_decodes = int(metadata.num_decodes)
    computed, query = batch.num_computed, batch.query_lens
    pairs = query * (computed + query)
    requests = []
    if num_decodes:
        requests.append(RequestRows(int(query[:num_decodes].sum()), int(pairs[:num_decodes].sum()),
                                    history_blocks(batch, 0, num_decodes), owner_capable,
                                    written_blocks(batch, 0, num_decodes)))
    # A prefill row without history attends over its own new keys, never the cache: on a rank reading
    # the layer from its scratch slot its blocks need no position there (their writes are dropped; the
    # owner's persistent copy is what later steps receive). So a step of fresh prompts packs nothing.
    # With streamed history, its history is in no slot either, and its writes are read by no rank but
    # the owner (whose gather follows the layer's cache write: a same-step prefix hit reads them there).
    resumed = computed > 0
    requests += [RequestRows(int(query[i]), int(pairs[i]),
                             EMPTY if streams_history else history_blocks(batch, i, i + 1), False,
                             written_blocks(batch, i, i + 1) if resumed[i] and not streams_history else EMPTY)
                 for i in range(num_decodes, batch.num_reqs)]
    return tuple(requests), num_decodes


@functools.cache
def owner_impl_class(cls: type) -> type:
    """A subclass of an MLA impl class whose ``forward_mqa`` runs on the layer's owner when the forward
    sends its decode rows there."""

    def forward_mqa(self, q: Any, kv_cache: torch.Tensor, attn_metadata: Any, layer: Any) -> Any:
        turn = open_turn(self._kvpp_engine, self._kvpp_layer)
        if turn is None or not turn.rows_to_owner:
            return cls.forward_mqa(self, q, kv_cache, attn_metadata, layer)
        query = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
        # fp8 queries (an fp8 cache's backends quantize them) travel as they are; the output is the model's dtype
        like = torch.empty(query.shape[0], query.shape[1], self.kv_lora_rank, dtype=self._kvpp_output_dtype,
                           device=query.device)
        backend = self._kvpp_backend

        def on_owner(full: list[torch.Tensor]) -> torch.Tensor:
            before_owner_call(backend, self)
            metadata = self._kvpp_engine.step.owner_metadata(backend, attn_metadata, full[0].shape[1],
                                                             self._kvpp_fp8_cache)
            return owner_call(backend, lambda q, metadata: cls.forward_mqa(self, q, kv_cache, metadata, layer)[0],
                              full[0].contiguous(), metadata, query.shape[1])

        part = turn.owner_compute(MQA_RULE, [query], on_owner, output_like=like)
        return part, None

    return type(f"KVPP{cls.__name__}", (cls,), {"forward_mqa": forward_mqa, "__module__": __name__})


def hook_impl(layer: Any, engine: Any, index: int) -> None:
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    impl = layer.impl
    impl._kvpp_engine, impl._kvpp_layer = engine, index
    impl._kvpp_backend = layer.get_attn_backend().get_name()
    impl._kvpp_output_dtype = engine.vllm_config.model_config.dtype
    impl._kvpp_fp8_cache = is_quantized_kv_cache(layer.kv_cache_dtype)
    impl.__class__ = owner_impl_class(type(impl))


def skips_cache_write(layer: Any) -> bool:
    """A non-owner in a forward whose every row goes to the owner writes nothing for the layer."""
    turn = open_turn(layer._kvpp_engine, layer._kvpp_layer)
    return turn is not None and turn.skips_cache_write

