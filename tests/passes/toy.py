"""A 4-layer toy MLA-style model over the reference model's paged-cache ops (and a vLLM-style variant).

It registers no op spec: a backend or pass configuration over these models is given
`tests.support.specs.TOY_SPECS`."""

from __future__ import annotations

import torch
from torch import nn

import kvpp_fx.reference.ops  # noqa: F401  (defines the kvpp_ref ops)
from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ModelCacheSpec
from tests.support import specs

HIDDEN, RANK, ROPE, HEADS, BLOCK, BLOCKS = 16, 8, 4, 2, 4, 8


class ToyMLALayer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.kv_a = nn.Linear(HIDDEN, RANK + ROPE, bias=False)
        self.q = nn.Linear(HIDDEN, HEADS * (RANK + ROPE), bias=False)
        self.o = nn.Linear(HEADS * RANK, HIDDEN, bias=False)

    def forward(self, x, cache, slot_mapping, block_table, seq_lens, query_lens):
        h = torch.tanh(x)
        kv_c, k_pe = self.kv_a(h).split([RANK, ROPE], dim=-1)
        q_latent, q_pe = self.q(h).view(-1, HEADS, RANK + ROPE).split([RANK, ROPE], dim=-1)
        torch.ops.kvpp_ref.write_kv(cache, kv_c, k_pe, slot_mapping, self.index)
        attn = torch.ops.kvpp_ref.mla_attention(q_latent, q_pe, cache, block_table, seq_lens, query_lens,
                                                0.5, self.index)
        return x + self.o(attn.flatten(1))


class ToyMLA(nn.Module):
    def __init__(self, num_layers: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(ToyMLALayer(i) for i in range(num_layers))

    def forward(self, x, caches: list[torch.Tensor], slot_mapping, block_table, seq_lens, query_lens):
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache, slot_mapping, block_table, seq_lens, query_lens)
        return x


def toy_spec(num_layers: int = 4, drafts: int = 0) -> ModelCacheSpec:
    """The shared toy cache spec at this model's latent width and block size."""
    return specs.toy_spec(num_layers, drafts, width=RANK + ROPE, block_size=BLOCK)


def toy_plan(num_layers: int = 4, drafts: int = 0, group_size: int = 1, **plan_options) -> KVPPPlan:
    return specs.toy_plan(num_layers, drafts, group_size=group_size, width=RANK + ROPE, block_size=BLOCK,
                          **plan_options)


def step_inputs(step: int, seq_len: int, new_tokens: int):
    """One request: positions seq_len-new_tokens .. seq_len-1, blocks 0..BLOCKS-1 in order."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(new_tokens, HIDDEN, generator=gen)
    positions = torch.arange(seq_len - new_tokens, seq_len)
    slot_mapping = positions.clone()
    block_table = torch.arange(BLOCKS, dtype=torch.int32)[None]
    return x, slot_mapping, block_table, torch.tensor([seq_len]), torch.tensor([new_tokens])


# (seq_len after the step, new tokens): a 6-token prefill, then decode steps that read the cache.
STEPS = [(6, 6), (7, 1), (8, 1), (9, 1), (12, 3), (13, 1)]


def replicated_run(model: nn.Module, num_layers: int) -> list[torch.Tensor]:
    """The uncompiled model over real replicated caches, through `STEPS`: the reference."""
    caches = replicated_caches(num_layers)
    outs = []
    with torch.no_grad():
        for step, (seq_len, new) in enumerate(STEPS):
            x, *meta = step_inputs(step, seq_len, new)
            outs.append(model(x, caches, *meta))
    return outs


def kvpp_run(model: nn.Module, plan: KVPPPlan, storage, group, device_api=None) -> tuple[list[torch.Tensor], list[int]]:
    """`model` (compiled with kvpp_backend) through `STEPS` over the runtime's handles, on a runtime over
    `storage` and `group` with `device_api`: its outputs and the broadcasts of each step."""
    from kvpp_fx.runtime.runtime import KVPPRuntime

    caches = runtime_caches(storage, plan.target_layers)
    outs, broadcasts = [], []
    with KVPPRuntime.create(plan, storage, group, device_api=device_api) as rt, torch.no_grad():
        for step, (seq_len, new) in enumerate(STEPS):
            x, *meta = step_inputs(step, seq_len, new)
            with rt.forward(has_history=step > 0):
                outs.append(model(x, caches, *meta))
            broadcasts.append(rt.last_forward()["broadcasts"])
    return outs, broadcasts


def replicated_caches(num_layers: int) -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, BLOCK, RANK + ROPE) for _ in range(num_layers)]


def runtime_caches(storage, layers) -> list[torch.Tensor]:
    """The graph's cache inputs under KVPP: handles that only kvpp.wait turns into real views."""
    return [storage.handles(i)["kv"] for i in layers]


def allocate(plan: KVPPPlan, rank: int = 0):
    return allocate_cache(plan, rank, BLOCKS)


# --- a vLLM-style op: the layer arrives as a name, the cache is looked up by that name ---------------

VLLM_STYLE_CACHES: dict[str, torch.Tensor] = {}


@torch.library.custom_op("toy_vllm::unified_attention", mutates_args=())
def unified_attention(q: torch.Tensor, layer_name: str) -> torch.Tensor:
    cache = VLLM_STYLE_CACHES[layer_name]
    return q * cache.float().mean()


@unified_attention.register_fake
def _(q, layer_name):
    return torch.empty_like(q)


class ToyVLLMStyle(nn.Module):
    def __init__(self, num_layers: int = 4) -> None:
        super().__init__()
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        self.proj = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(num_layers))

    def forward(self, x):
        for proj, name in zip(self.proj, self.names):
            x = x + torch.ops.toy_vllm.unified_attention(proj(x), name)
        return x


# --- variants for the refusal and graph-break tests -----------------------------------------------

class ToyMLAStrayRead(ToyMLA):
    """Layer 1 also reads its cache through an op the pass does not know (``cache.mean()``)."""

    def forward(self, x, caches, slot_mapping, block_table, seq_lens, query_lens):
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x = layer(x, cache, slot_mapping, block_table, seq_lens, query_lens)
            if i == 1:
                x = x + 1e-2 * cache.mean()
        return x


@torch.library.custom_op("toy_unregistered::attention", mutates_args=())
def unregistered_attention(q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    return q * cache.float().mean()


@unregistered_attention.register_fake
def _(q, cache):
    return torch.empty_like(q)


class ToyUnregistered(nn.Module):
    """Attention through an op that no AttentionOpSpec names."""

    def __init__(self, num_layers: int = 4) -> None:
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(num_layers))

    def forward(self, x, caches, slot_mapping, block_table, seq_lens, query_lens):
        for proj, cache in zip(self.proj, caches):
            x = x + torch.ops.toy_unregistered.attention(proj(x), cache)
        return x


BREAKS = ("between_layers", "inside_layer", "after_last_layer")


class ToyMLABreakingLayer(ToyMLALayer):
    """Breaks the graph after its projections, before its first cache op."""

    def forward(self, x, cache, slot_mapping, block_table, seq_lens, query_lens):
        h = torch.tanh(x)
        kv_c, k_pe = self.kv_a(h).split([RANK, ROPE], dim=-1)
        q_latent, q_pe = self.q(h).view(-1, HEADS, RANK + ROPE).split([RANK, ROPE], dim=-1)
        torch._dynamo.graph_break()
        torch.ops.kvpp_ref.write_kv(cache, kv_c, k_pe, slot_mapping, self.index)
        attn = torch.ops.kvpp_ref.mla_attention(q_latent, q_pe, cache, block_table, seq_lens, query_lens,
                                                0.5, self.index)
        return x + self.o(attn.flatten(1))


class ToyMLAWithBreak(ToyMLA):
    """ToyMLA with one Dynamo graph break: after layer 1, inside layer 2 (before its cache ops), or after
    the last layer. Same weights as ``ToyMLA(num_layers, seed)``."""

    def __init__(self, where: str, seed: int = 0) -> None:
        super().__init__(4, seed)
        if where not in BREAKS:
            raise ValueError(f"where must be one of {BREAKS}, got {where!r}.")
        self.where = where
        if where == "inside_layer":
            old = self.layers[2]
            new = ToyMLABreakingLayer(2)
            new.load_state_dict(old.state_dict())
            self.layers[2] = new

    def forward(self, x, caches, *meta):
        # unrolled: Dynamo skips a whole frame that graph-breaks inside a loop
        x = self.layers[0](x, caches[0], *meta)
        x = self.layers[1](x, caches[1], *meta)
        if self.where == "between_layers":
            torch._dynamo.graph_break()
        x = self.layers[2](x, caches[2], *meta)
        x = self.layers[3](x, caches[3], *meta)
        if self.where == "after_last_layer":
            torch._dynamo.graph_break()
            x = torch.tanh(x) * 2
        return x
