"""Owner mode's exchange: a head-separable op of one layer runs on the layer's owner over every rank's heads.

Per routed op: every rank packs its head operands into one buffer (one-byte floats, such as fp8 queries,
as their bytes) and one gather brings the buffers to the owner; the owner concatenates each operand along
its head dimension in rank order (TP rank r holds heads r·H/N .. (r+1)·H/N - 1, so this is the full head
order), runs the op once, splits the output along its head dimension and one scatter gives every rank its
part, followed by one status value (non-zero: the owner failed, and the part is zeros). Both collectives
run on the current stream in program order, on the runtime's exchange group (its own communicator, so that
an exchange never queues behind the next layer's broadcast), and the current stream waits for each (the
host too, on CPU, bounded by the timeout; on a device the communicator's watchdog bounds them). On a device
the status values are read on the host later, without waiting (`PendingChecks`).

Invariant: before anything is issued, every head operand holds the forward's agreed query tokens on
its token dimension (and, with an attention shape, the rank's share of the heads), and all have one
dtype: buffers of different sizes would pair wrongly in the gather (gloo fills a short buffer silently
and aborts on a long one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpp_fx.runtime.collectives import Collectives
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import OwnerRoutingError
from kvpp_fx.runtime.stats import TransferStats
from kvpp_fx.runtime.timeline import Timeline


def as_wire(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as the collectives carry it: one-byte floats (fp8 queries) as their bytes, since gloo has no
    fp8 type and NCCL not every one; the owner views them back."""
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


@dataclass(frozen=True)
class HeadRule:
    """How a head-separable op's call splits by head: what owner mode gathers and scatters."""

    heads: tuple[tuple[Any, int], ...]  # (where the operand is in the call, its head dimension)
    token_dims: tuple[int, ...]  # each head operand's query-token dimension
    output_dim: int  # the output's head dimension
    output_like: int = 0  # the head operand whose shape and dtype the output has


class OwnerExchange:
    """The exchanges of one owner-mode forward: what it issued last, and the owners' status values."""

    def __init__(self, api: DeviceAPI, collectives: Collectives, group: Any, group_size: int,
                 local_heads: int | None, query_tokens: int, stats: TransferStats, timeline: Timeline | None) -> None:
        self.api = api
        self.collectives = collectives
        self.group = group
        self.group_size = group_size
        self.local_heads = local_heads  # from the runtime's attention shape, when it has one
        self.query_tokens = query_tokens
        self.stats = stats
        self.timeline = timeline
        self.issued = 0  # exchanges started: a failure after the first may have left a peer's half pending
        self.failed: torch.Tensor | None = None  # on a device: the maximum of the owners' status values
        self.exchanged: set[int] = set()  # layers whose owner rows were exchanged in this forward
        self.failed_here = False  # this rank's op failed as a layer's owner (its status told the others)

    def compute(self, layer: int, position: int, owned: bool, owner: int, rule: HeadRule,
                heads: Sequence[torch.Tensor], compute: Callable[[list[torch.Tensor]], torch.Tensor],
                output_like: torch.Tensor | None = None) -> torch.Tensor:
        """Run the op over every rank's heads on `owner` (a global rank); return this rank's part.

        ``output_like``: a tensor of this rank's output shape and dtype, for an op whose output is not
        shaped like one of its head operands (vLLM's MQA: queries of 576 values in, 512 out per head)."""
        dims = [dim for _, dim in rule.heads]
        self._check_heads(layer, heads, dims, rule.token_dims)
        like = heads[rule.output_like] if output_like is None else output_like
        pack = torch.cat([t.contiguous().view(-1) for t in heads]) if len(heads) > 1 else \
            heads[0].contiguous().view(-1)
        pack = as_wire(pack)
        nbytes = pack.numel() * pack.element_size() + like.numel() * like.element_size()
        self.issued += 1  # counted first: a failure while issuing may have left a peer's half pending
        self.exchanged.add(layer)
        start = time.perf_counter_ns()
        gathered = [torch.empty_like(pack) for _ in range(self.group_size)] if owned else None
        self.collectives.run(lambda: self.api.gather(pack, gathered, owner, self.group),
                             "owner-mode gather of layer %d", layer)
        received = torch.empty(like.numel() + 1, dtype=like.dtype, device=like.device)
        parts, failure = None, None
        if owned:
            try:
                gathered = [g.view(heads[0].dtype) for g in gathered]
                parts = self._owner_parts(layer, heads, dims, gathered, compute, like, rule)
            except Exception as exc:  # the other ranks learn it from the scatter instead of a timeout
                failure = exc
                parts = [torch.cat([torch.zeros_like(like).view(-1), like.new_ones(1)])
                         for _ in range(self.group_size)]
        self.collectives.run(lambda: self.api.scatter(received, parts, owner, self.group),
                             "owner-mode scatter of layer %d", layer)
        if failure is not None:  # every rank raises the same named error: here with the op's own as its cause
            self.failed_here = True
            raise OwnerRoutingError(f"layer {layer}: the op failed on this rank, the layer's owner "
                                    f"({type(failure).__name__}: {failure}); the other ranks received zeros and "
                                    "a failure status.") from failure
        self._check_status(layer, received[-1:])
        self.stats.record_exchange(position, nbytes * (self.group_size - 1) if owned else nbytes)
        if self.timeline is not None:
            self.timeline.add(f"exchange L{layer}", "exchange", start, time.perf_counter_ns(),
                              track="kvpp transfer stream", layer=layer, bytes=nbytes, owner=owner)
        part = received[:-1].view(like.shape)
        if like.is_contiguous():
            return part
        # the op's output has the strides of its head operand (its fake says so); inductor checks them
        return torch.empty_like(like).copy_(part)

    # --- steps ------------------------------------------------------------------------------------

    def _check_heads(self, layer: int, heads: Sequence[torch.Tensor], dims: list[int],
                     token_dims: Sequence[int]) -> None:
        for i, (tensor, dim, token_dim) in enumerate(zip(heads, dims, token_dims)):
            if not (-tensor.dim() <= dim < tensor.dim() and -tensor.dim() <= token_dim < tensor.dim()):
                raise OwnerRoutingError(f"layer {layer}: head operand {i} is {tuple(tensor.shape)}; its declared "
                                        f"head dimension {dim} or token dimension {token_dim} does not exist.")
            if tensor.shape[token_dim] != self.query_tokens:
                raise OwnerRoutingError(
                    f"layer {layer}: head operand {i} holds {tensor.shape[token_dim]} query tokens, the forward's "
                    f"load {self.query_tokens}; owner mode gathers equal buffers from every rank.")
            if self.local_heads is not None and tensor.shape[dim] != self.local_heads:
                raise OwnerRoutingError(f"layer {layer}: head operand {i} holds {tensor.shape[dim]} heads, the "
                                        f"runtime's attention shape {self.local_heads} per rank.")
            if tensor.dtype != heads[0].dtype:
                raise OwnerRoutingError(f"layer {layer}: head operands of dtypes {heads[0].dtype} and "
                                        f"{tensor.dtype}; owner mode packs them into one buffer of one dtype.")

    def _owner_parts(self, layer: int, heads: Sequence[torch.Tensor], dims: list[int], gathered: list[torch.Tensor],
                     compute: Callable[[list[torch.Tensor]], torch.Tensor], like: torch.Tensor,
                     rule: HeadRule) -> list[torch.Tensor]:
        """The owner's side: all heads in rank order, the op, and each rank's part plus a zero status."""
        full, offset = [], 0
        for tensor, dim in zip(heads, dims):
            n = tensor.numel()
            full.append(torch.cat([g[offset:offset + n].view(tensor.shape) for g in gathered], dim=dim))
            offset += n
        out = compute(full)
        expected = list(like.shape)
        expected[rule.output_dim] = like.shape[rule.output_dim] * self.group_size
        if not isinstance(out, torch.Tensor) or list(out.shape) != expected or out.dtype != like.dtype:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise OwnerRoutingError(
                f"layer {layer}: the op's output over all heads is {got}; its declaration says "
                f"{tuple(expected)} {like.dtype} (the shape of head operand {rule.output_like} with heads on "
                f"dimension {rule.output_dim}).")
        zero = like.new_zeros(1)
        return [torch.cat([p.contiguous().view(-1), zero])
                for p in out.split(like.shape[rule.output_dim], dim=rule.output_dim)]

    def _check_status(self, layer: int, status: torch.Tensor) -> None:
        if self.api.immediate_checks:
            if bool(status.item()):
                raise OwnerRoutingError(f"the owner of layer {layer} failed to compute it (see its error); "
                                        "this rank received no output.")
        else:  # read on the host later (`PendingChecks`)
            self.failed = status if self.failed is None else torch.maximum(self.failed, status)
