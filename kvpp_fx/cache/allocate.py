"""Physical cache allocation for one rank of a KVPP group.

Invariants:
- The rank allocates exactly ``plan.buffers(rank)``: one zeroed, 2 MiB-padded buffer per owned target
  bundle and per local draft cache, plus ``depth`` scratch buffers sized to the largest target bundle.
  Nothing else holds cache bytes, so ``allocated_bytes == plan.bytes_for(num_blocks, rank)``.
- Every layer has one contiguous byte view over its whole bundle: its persistent buffer where the rank
  keeps it, ``scratch[plan.slot(layer)]`` otherwise. Layers that share a slot share bytes; no other
  layers do.
- Every component has a typed view ``[num_blocks, block_size, *per_token]`` over the byte view, at the
  component-major offset of ``plan.layout``, and a block view ``[num_blocks, bytes_per_block]`` (uint8)
  over the same bytes, which active-block broadcasts gather from and scatter into whatever the dtype.
- A rank of an enabled group has one staging buffer (``plan.staging_blocks``) for active-block
  broadcasts; it holds no cache state between layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpp_fx.cache.placement import KVPPPlan

TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


@dataclass
class CacheStorage:
    """The cache bytes of one rank and the views over them."""

    plan: KVPPPlan
    rank: int
    num_blocks: int
    device: torch.device
    persistent: dict[int, torch.Tensor] = field(repr=False)  # layer -> owned bundle or local draft
    scratch: tuple[torch.Tensor, ...] = field(repr=False)
    byte_views: dict[int, torch.Tensor] = field(repr=False)
    typed: dict[int, dict[str, torch.Tensor]] = field(repr=False)
    staging: torch.Tensor | None = field(default=None, repr=False)

    @property
    def allocated_bytes(self) -> int:
        staging = self.staging.numel() if self.staging is not None else 0
        return sum(b.numel() for b in self.persistent.values()) + sum(b.numel() for b in self.scratch) + staging

    def block_views(self, layer: int) -> list[torch.Tensor]:
        """Per component, in layout order: ``[num_blocks, bytes_per_block]`` uint8 over the layer's bytes."""
        view = self.byte_view(layer)
        return [view[where.offset: where.offset + where.size].view(self.num_blocks, -1)
                for where in self.plan.layout(layer, self.num_blocks)]

    @property
    def persistent_layers(self) -> tuple[int, ...]:
        """Layers whose bytes this rank keeps across steps (read from the buffers, not the plan)."""
        return tuple(sorted(self.persistent))

    def byte_view(self, layer: int) -> torch.Tensor:
        try:
            return self.byte_views[layer]
        except KeyError:
            raise KeyError(f"layer {layer} has no cache on rank {self.rank}.") from None

    def typed_views(self, layer: int) -> dict[str, torch.Tensor]:
        self.byte_view(layer)
        return self.typed[layer]

    def handles(self, layer: int) -> dict[str, torch.Tensor]:
        """Stand-ins for the graph's cache inputs: the typed views' shapes and dtypes, no bytes.

        A compiled model takes these where a replicated run takes its caches; ``kvpp.wait`` swaps them
        for the real views. Each is a zero-stride expansion of one element with no cache bytes
        behind it; cache ops refuse such a tensor, so only a rebound graph can use the cache.
        """
        return {name: torch.empty((), dtype=view.dtype, device=view.device).expand(view.shape)
                for name, view in self.typed_views(layer).items()}


def allocate_cache(plan: KVPPPlan, rank: int, num_blocks: int,
                   device: torch.device | str = "cpu") -> CacheStorage:
    """Allocate `rank`'s cache for `num_blocks` blocks as the plan lays it out."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}.")
    device = torch.device(device)
    persistent: dict[int, torch.Tensor] = {}
    scratch: list[torch.Tensor] = []
    staging = None
    for buf in plan.buffers(rank):
        tensor = torch.zeros(buf.nbytes(num_blocks), dtype=torch.uint8, device=device)
        if buf.kind == "scratch":
            scratch.append(tensor)
        elif buf.kind == "staging":
            staging = tensor
        else:
            persistent[buf.key] = tensor

    byte_views: dict[int, torch.Tensor] = {}
    typed: dict[int, dict[str, torch.Tensor]] = {}
    for layer in plan.layers:
        backing = persistent[layer] if plan.is_local(layer, rank) else scratch[plan.slot(layer)]
        view = backing[: num_blocks * plan.bundle_bytes_per_block(layer)]
        byte_views[layer] = view
        typed[layer] = _typed_views(plan, layer, view, num_blocks)
    return CacheStorage(plan, rank, num_blocks, device, persistent, tuple(scratch), byte_views, typed, staging)


def _typed_views(plan: KVPPPlan, layer: int, view: torch.Tensor, num_blocks: int) -> dict[str, torch.Tensor]:
    spec = plan.spec.layer(layer)
    out = {}
    for comp, where in zip(spec.components, plan.layout(layer, num_blocks)):
        raw = view[where.offset: where.offset + where.size]
        out[comp.name] = raw.view(TORCH_DTYPES[comp.dtype]).view(
            num_blocks, plan.spec.block_size, *comp.per_token)
    return out
