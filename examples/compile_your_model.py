"""Your own tensor-parallel MLA model under KVPP, checked against the same model with KVPP off. Its latent
cache is the same on every rank, so KVPP keeps each layer's cache on one rank only. Attention touches the
cache only through two custom ops, whose `AttentionOpSpec`s tell the KVPP pass where their layer and cache are."""

import argparse
import contextlib
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from kvpp_fx import (AttentionOpSpec, AttentionShape, CacheOperand, ComponentSpec, HeadOperand, HeadSeparable,
                     KVPPPlan, KVPPRuntime, LayerCacheSpec, ModelCacheSpec, OwnerLocal, StepLoad, TableOperand,
                     allocate_cache, default_device, kvpp_backend, process_group_backend, resolve_device_api)

LAYERS, HIDDEN, HEADS, WIDTH, VOCAB = 8, 64, 4, 32, 256  # WIDTH: latent values per token (and per query head)
BLOCK_SIZE, KV_MEMORY, PROMPT, DECODE_STEPS = 16, 64 << 20, 40, 4


class UnboundCacheError(RuntimeError):
    """A KVPP handle (cache-shaped, no bytes of its own) reached a cache op: its layer was not rebound."""


@torch.library.custom_op("example::write_kv", mutates_args=("cache",))
def write_kv(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor, layer: int) -> None:
    """cache [num_blocks, BLOCK_SIZE, WIDTH]; a token's slot is block * BLOCK_SIZE + offset."""
    if 0 in cache.stride():
        raise UnboundCacheError(f"layer {layer}: is the model compiled with kvpp_backend?")
    cache.view(-1, WIDTH)[slot_mapping] = latent


@torch.library.custom_op("example::mla_attention", mutates_args=())
def mla_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_len: torch.Tensor,
                  layer: int) -> torch.Tensor:
    """One request's last T queries q [T, heads, WIDTH] over its first seq_len cached tokens, causal."""
    if 0 in cache.stride():
        raise UnboundCacheError(f"layer {layer}: is the model compiled with kvpp_backend?")
    tokens, heads, length = q.shape[0], q.shape[1], int(seq_len)
    blocks = block_table[: (length + BLOCK_SIZE - 1) // BLOCK_SIZE]  # only the blocks that hold the context
    context = cache[blocks].view(-1, WIDTH)[:length].expand(heads, -1, -1)
    # Batched over heads: a head's result does not depend on how many heads share the call, so owner
    # mode (every rank's heads in one call on the layer's owner) is bit-identical too.
    scores = torch.bmm(q.transpose(0, 1), context.transpose(1, 2)) * WIDTH ** -0.5
    future = torch.ones(tokens, length, dtype=torch.bool, device=q.device).triu(length - tokens + 1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.bmm(probs, context).transpose(0, 1).contiguous()


write_kv.register_fake(lambda cache, latent, slot_mapping, layer: None)
mla_attention.register_fake(lambda q, cache, block_table, seq_len, layer: torch.empty_like(q))

# Each op's layer argument, cache operand and block ids (a rank that reads a layer from its scratch slot
# gets them remapped to the blocks the slot holds), and how owner mode runs it: attention on the layer's
# owner over every rank's heads (q's dimension 1, and the output's), the write on the owner only.
SPECS = (
    AttentionOpSpec("example::write_kv", ("layer", 3), cache_operands=(CacheOperand(("cache", 0)),),
                    owner=OwnerLocal(), tables=(TableOperand(("slot_mapping", 2), "slot_mapping"),)),
    AttentionOpSpec("example::mla_attention", ("layer", 4), cache_operands=(CacheOperand(("cache", 1)),),
                    owner=HeadSeparable((HeadOperand(("q", 0), dim=1),), output_dim=1),
                    tables=(TableOperand(("block_table", 2), "block_table"),)),
)


class Layer(nn.Module):
    def __init__(self, index: int, rank: int, world: int, tp_group: dist.ProcessGroup) -> None:
        super().__init__()
        self.index, self.heads, self.tp_group = index, HEADS // world, tp_group
        self.latent = nn.Linear(HIDDEN, WIDTH, bias=False)  # the same on every rank: what the cache holds
        self.q = nn.Linear(HIDDEN, HEADS * WIDTH, bias=False)
        self.o = nn.Linear(HEADS * WIDTH, HIDDEN, bias=False)
        self.q.weight = nn.Parameter(self.q.weight.chunk(world, 0)[rank].clone())  # this rank's heads
        self.o.weight = nn.Parameter(self.o.weight.chunk(world, 1)[rank].clone())

    def forward(self, x, cache, slot_mapping, block_table, seq_len):
        h = F.rms_norm(x, (HIDDEN,))
        torch.ops.example.write_kv(cache, self.latent(h), slot_mapping, self.index)
        q = self.q(h).view(-1, self.heads, WIDTH)
        out = torch.ops.example.mla_attention(q, cache, block_table, seq_len, self.index)
        return x + funcol.all_reduce(self.o(out.flatten(1)), "sum", self.tp_group)


class TinyMLA(nn.Module):
    def __init__(self, rank: int, world: int, tp_group: dist.ProcessGroup) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same full weights on every rank; each keeps its heads
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer(i, rank, world, tp_group) for i in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, caches, slot_mapping, block_table, seq_len):
        x = self.embed(tokens)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache, slot_mapping, block_table, seq_len)
        return self.head(F.rms_norm(x, (HIDDEN,)))


def generate(model, caches, block_table, step) -> list[torch.Tensor]:
    """A prompt, then greedy decode steps, each inside ``step(computed_tokens, new_tokens)``; their logits."""
    tokens = torch.randint(VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1)).to(block_table.device)
    logits, computed = [], 0
    for _ in range(1 + DECODE_STEPS):
        positions = torch.arange(computed, len(tokens), device=block_table.device)
        slots = block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        with step(computed, len(positions)):
            logits.append(model(tokens[computed:], caches, slots, block_table, torch.tensor(len(tokens))))
        computed, tokens = len(tokens), torch.cat([tokens, logits[-1][-1:].argmax(-1)])
    return logits


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvpp-mode", default="auto", choices=("broadcast", "owner", "auto"))
    parser.add_argument("--device-api", help="module:callable making the runtime's DeviceAPI (tests' faults)")
    args = parser.parse_args()
    device = default_device()
    dist.init_process_group(process_group_backend(device), timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type != "cpu":
        device = torch.device(device.type, int(os.environ["LOCAL_RANK"]))
        torch.accelerator.set_device_index(device.index)
    kvpp_group = dist.new_group(timeout=timedelta(seconds=60))  # KVPP's broadcasts get their own communicator
    model = TinyMLA(rank, world, dist.group.WORLD).to(device)

    # region readme
    cache_spec = ModelCacheSpec("tiny-mla", BLOCK_SIZE, tuple(
        LayerCacheSpec(i, (ComponentSpec("kv", "float32", (WIDTH,)),)) for i in range(LAYERS)))
    plan = KVPPPlan(cache_spec, group_size=world)  # owners, slots, budget (pure maths)
    num_blocks = plan.num_blocks(KV_MEMORY)
    storage = allocate_cache(plan, rank, num_blocks, device)
    runtime = KVPPRuntime.create(plan, storage, kvpp_group, attention=AttentionShape(HEADS, WIDTH, WIDTH, 4),
                                 device_api=resolve_device_api(args.device_api, device) if args.device_api else None)
    backend = kvpp_backend(plan, mode="piecewise", inner="aot_eager", specs=SPECS)
    compiled = torch.compile(model, backend=backend)
    handles = [runtime.handles(layer)["kv"] for layer in plan.target_layers]
    block_table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))[:8].to(device)  # anywhere

    def kvpp_step(computed: int, new: int):
        for record in backend.records:  # "auto" picks owner mode only for layers compiled with routed ops
            runtime.note_routing(*record.routed_layers(plan.target_layers))
        filled = (computed + BLOCK_SIZE - 1) // BLOCK_SIZE
        history = block_table[:filled]  # the blocks holding computed tokens
        written = block_table[filled:(computed + new + BLOCK_SIZE - 1) // BLOCK_SIZE]  # and the ones it fills
        return runtime.forward(has_history=computed > 0, blocks=history, written=written, mode=args.kvpp_mode,
                               load=StepLoad(new, new * (computed + new)))

    with torch.no_grad():
        kvpp_logits = generate(compiled, handles, block_table, kvpp_step)
        replicated = [torch.zeros(num_blocks, BLOCK_SIZE, WIDTH, device=device) for _ in range(LAYERS)]
        reference = generate(model, replicated, block_table, lambda computed, new: contextlib.nullcontext())
    # endregion readme
    differ = [step for step, (a, b) in enumerate(zip(kvpp_logits, reference)) if not torch.equal(a, b)]
    modes = ", ".join(f"{mode} {count}" for mode, count in runtime.stats()["modes"].items() if count)
    verdict = f"DIFFER from KVPP off at steps {differ}" if differ else "identical to KVPP off"
    lines = [None] * world  # rank 0 prints every rank's line, in rank order
    dist.all_gather_object(lines, f"rank {rank}: logits of {len(reference)} steps ({modes}) {verdict}; {num_blocks} "
                           f"blocks vs {plan.replicated_num_blocks(KV_MEMORY)} replicated in {KV_MEMORY >> 20} MiB "
                           f"({plan.capacity_ratio(KV_MEMORY):.2f}x)")
    if rank == 0:
        print("\n".join(lines))
    runtime.close()
    dist.destroy_process_group()
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
