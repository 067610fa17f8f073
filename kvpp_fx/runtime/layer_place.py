"""`LayerPlace`: one target layer as every forward's ops need it (its slot, owner and views), built once
per runtime by `parts.layer_place`; in a module of its own so that what acts on a place (the transport,
the history stream, the turn) need not import the parts that build it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvpp_fx.runtime.active_blocks import Shape


@dataclass(frozen=True)
class LayerPlace:
    """One target layer as the ops of every forward need it, computed once per runtime."""

    layer: int
    position: int  # in the plan's order
    slot: int
    owned: bool
    src: int  # the owner's global rank
    view: torch.Tensor  # this rank's bytes of the layer: persistent on the owner, its scratch slot elsewhere
    nbytes: int  # of a whole-layer broadcast
    block_views: tuple[torch.Tensor, ...]  # per component, [blocks, bytes per block], over `view`
    shape: Shape
    typed_views: Mapping[str, torch.Tensor]  # per component, its typed view over `view`: what graphs read
    pack_views: tuple[torch.Tensor, ...] = ()  # the owner: per component, [S, bytes per block] of its own slot
    whole: tuple[torch.Tensor, ...] = ()  # a whole-layer broadcast's payload: (view,)
