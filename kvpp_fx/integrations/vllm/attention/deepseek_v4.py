"""Owner mode for DeepSeek-V4's attention on vLLM CPU: every row of a layer runs on the layer's owner.

vLLM CPU's ``DeepseekV4CPUAttention`` runs a layer's attention in ``_prepare_and_attn`` (inside its opaque op
``deepseek_v4_cpu_prepare_and_attn``, so eagerly in every compile mode and with either model runner): this
rank's queries ``wq_b(qr)`` ``[T, H/N, D]``; the window-cache insert, fused with the queries' norm and RoPE;
the compressors, which write their states and the compressed KV; the indexer, which writes its keys and
picks the top-k compressed rows; and the sparse attention into ``o_padded`` ``[T, H/N, D]``. Of all that only
``wq_b`` and the attention sinks are per head: every other input is replicated over the TP group.

With KVPP, each target layer's ``_prepare_and_attn_fn`` is `OwnerRoutedAttention`: every rank computes its
queries and the runtime's `OwnerExchange` gathers them on the layer's owner, which runs vLLM's own
``_prepare_and_attn`` once for all H heads (a copy of the module that reports H local heads, reads the
gathered queries and the sinks of every head, gathered once after loading) and returns each rank its heads'
output. A non-owner writes none of the layer's caches and runs neither its compressors nor its indexer; the
caches of layers it does not own are empty tensors (`cache.deepseek_v4`). Per layer and step a non-owner
ships ``T x H/N x D`` query values and receives as many output values, whatever the context.

A run without attention metadata (vLLM's profile and warm-up runs) runs vLLM's body unchanged: it reads and
writes no cache. The layers of the MTP model are local on every rank and keep vLLM's body.

Invariant: within one forward every rank routes the same layers in the same order with the same token count
(the TP group runs one batch), so the exchange's gathers pair; a rank whose state is broken raises before
issuing anything (`Health`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from kvpp_fx.runtime.errors import OwnerRoutingError
from kvpp_fx.runtime.owner_exchange import HeadRule, OwnerExchange

# The queries [T, h, D], heads on dimension 1; the output has their shape.
QUERY_RULE = HeadRule(heads=((0, 1),), token_dims=(0,), output_dim=1, output_like=0)
ATTENTION_CLASS = "vllm.models.deepseek_v4.cpu.cpu_sparse.DeepseekV4CPUAttention"


def attention_class() -> type:
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    return DeepseekV4CPUAttention


class OwnerRoutedAttention:
    """One target layer's ``_prepare_and_attn_fn``: vLLM's own outside a real forward, the owner's call in one."""

    def __init__(self, module: Any, layer: int, engine: Any) -> None:
        self.module = module
        self.layer = layer
        self.engine = engine
        self.vllm_fn = module._prepare_and_attn_fn
        self.sinks: torch.Tensor | None = None  # every head's, once gathered
        self.sinks_version = -1  # of this rank's sinks when gathered: a weight reload changes them in place

    def use_sinks(self, sinks: torch.Tensor) -> None:
        """The sinks of every head, in TP rank order: the owner's call reads them."""
        self.sinks, self.sinks_version = sinks, self.module.attn_sink._version

    def all_heads(self, queries: torch.Tensor) -> Any:
        """The module as the owner runs it: H local heads, the gathered `queries`, every head's sinks. A shallow
        copy made per call (the same submodules, weights and caches as bound now); its instance attributes
        shadow the module's own, since nn.Module looks there first."""
        full = copy.copy(self.module)
        heads = queries.shape[1]
        full.__dict__.update(n_local_heads=heads, padded_heads=heads, attn_sink=self.sinks,
                             _wq_b_proj=lambda qr, qr_scale: queries)
        return full

    def __call__(self, hidden_states: torch.Tensor, qr: torch.Tensor, kv: torch.Tensor, qr_scale: Any,
                 kv_score: Any, indexer_kv_score: Any, indexer_weights: Any, positions: torch.Tensor,
                 o_padded: torch.Tensor) -> None:
        from vllm.forward_context import get_forward_context

        if not isinstance(get_forward_context().attn_metadata, dict):
            return self.vllm_fn(hidden_states, qr, kv, qr_scale, kv_score, indexer_kv_score, indexer_weights,
                                positions, o_padded)
        module, engine = self.module, self.engine
        if self.sinks is None:
            raise OwnerRoutingError(f"layer {self.layer}: DeepSeek-V4 attention ran before KVPP gathered the "
                                    "attention sinks (the KV cache is not allocated yet).")
        if module.attn_sink._version != self.sinks_version:
            raise OwnerRoutingError(f"layer {self.layer}: its attention sinks changed after KVPP gathered every "
                                    "head's for the owner (weights reloaded in place); restart the engine to serve "
                                    "the new weights with KVPP.")
        local_heads = module.n_local_heads
        queries = module._wq_b_proj(qr, qr_scale).view(-1, local_heads, module.head_dim)
        owner = engine.owner(self.layer)  # a rank of the KVPP group, chosen with the budget

        def on_owner(full: list[torch.Tensor]) -> torch.Tensor:
            out = full[0].new_empty(full[0].shape)
            type(module)._prepare_and_attn(self.all_heads(full[0]), hidden_states, qr, kv, qr_scale, kv_score,
                                           indexer_kv_score, indexer_weights, positions, out)
            return out

        exchange = engine.exchange(self.layer, local_heads, queries.shape[0])
        part = exchange.compute(self.layer, engine.position(self.layer), owner == engine.rank,
                                engine.global_rank(owner), QUERY_RULE, [queries], on_owner, output_like=queries)
        engine.note_exchange(self.layer)
        o_padded[:, :local_heads].copy_(part)


def hook_model(model: Any, engine: Any) -> dict[int, OwnerRoutedAttention]:
    """Route every target layer's DeepSeek-V4 attention in `model` through its owner; returns the hooks."""
    cls = attention_class()
    hooks = {}
    for name, module in model.named_modules():
        if not isinstance(module, cls):
            continue
        layer = engine.layer_of(name)
        if layer is None:  # an MTP layer: local on every rank
            continue
        hook = OwnerRoutedAttention(module, layer, engine)
        module._prepare_and_attn_fn = hook
        hooks[layer] = hook
    missing = sorted(set(engine.target_layers) - set(hooks))
    if missing:
        raise OwnerRoutingError(f"KVPP found no {ATTENTION_CLASS} for target layers {missing}: it runs DeepSeek-V4 "
                                "only on vLLM CPU's attention.")
    return hooks


def gather_sinks(hooks: dict[int, OwnerRoutedAttention], group: Any) -> None:
    """Every layer's attention sinks of every head, in TP rank order, for its owner's call (once)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    for layer in sorted(hooks):
        sink = hooks[layer].module.attn_sink.detach()
        parts = [torch.empty_like(sink) for _ in range(size)]
        dist.all_gather(parts, sink.contiguous(), group=group)
        hooks[layer].use_sinks(torch.cat(parts))


def new_exchange(engine: Any, local_heads: int, query_tokens: int) -> OwnerExchange:
    return OwnerExchange(engine.api, engine.collectives, engine.exchange_group, engine.group_size, local_heads,
                         query_tokens, engine.stats, None)
