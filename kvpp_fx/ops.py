"""The two KVPP graph ops, registered with torch.library in the ``kvpp`` namespace.

    kvpp::prefetch(int layer, int slot) -> ()
    kvpp::wait(int layer, int slot, Tensor[] caches, str[] components) -> Tensor[]

``wait`` takes the cache tensors the graph had for the layer before the rewrite (one per cache
component its attention/cache ops read) and returns, in the same order, the views those ops must read
instead: persistent on the owner rank, the layer's scratch slot elsewhere. The component names let the
runtime pick the right typed view of the layer's bundle (an SFA layer has the latent cache, the
indexer keys and their scales). See docs/graph-contract.md.

Both ops are registered as ORDERED-effectful, so fx dead-code elimination, AOTAutograd and inductor keep
them (AOT threads effect tokens through them). Both call the runtime of the current
``runtime.forward(...)`` context and raise `NoActiveForwardError` outside one.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch._library.effects import EffectType

from kvpp_fx.runtime.runtime import active_runtime, current_runtime

NAMESPACE = "kvpp"

_lib = torch.library.Library(NAMESPACE, "DEF")
_lib.define("prefetch(int layer, int slot) -> ()")
_lib.define("wait(int layer, int slot, Tensor[] caches, str[] components) -> Tensor[]")


_PASSTHROUGH: contextvars.ContextVar[bool] = contextvars.ContextVar("kvpp_passthrough", default=False)


@contextlib.contextmanager
def passthrough() -> Iterator[None]:
    """Outside any forward, let the ops do nothing: prefetch returns, wait returns its inputs.

    For an engine's dummy, profile and warm-up runs through a rewritten graph, which happen before any
    cache exists and must move nothing.
    """
    token = _PASSTHROUGH.set(True)
    try:
        yield
    finally:
        _PASSTHROUGH.reset(token)


def passing_through() -> bool:
    """Inside `passthrough()` and outside any runtime forward: the kvpp ops do nothing."""
    return _PASSTHROUGH.get() and active_runtime() is None


def _prefetch_impl(layer: int, slot: int) -> None:
    if passing_through():
        return
    current_runtime().prefetch(layer, slot)


def _wait_impl(layer: int, slot: int, caches: list[torch.Tensor], components: list[str]) -> list[torch.Tensor]:
    if len(caches) != len(components):
        raise ValueError(f"kvpp.wait for layer {layer}: {len(caches)} caches but {len(components)} component names.")
    if passing_through():
        return list(caches)
    runtime = current_runtime()
    runtime.wait(layer, slot)
    views = runtime.typed_views(layer)
    out = []
    for cache, name in zip(caches, components):
        if name not in views:
            raise KeyError(f"layer {layer} has no cache component {name!r}; it has {sorted(views)}.")
        view = views[name]
        if view.shape != cache.shape or view.dtype != cache.dtype:
            raise ValueError(
                f"kvpp.wait for layer {layer}: the graph's {name!r} cache is {tuple(cache.shape)} "
                f"{cache.dtype}, the runtime's view is {tuple(view.shape)} {view.dtype}.")
        out.append(view)
    return out


_lib.impl("prefetch", _prefetch_impl, "CompositeExplicitAutograd")
_lib.impl("wait", _wait_impl, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{NAMESPACE}::prefetch", lib=_lib)
def _prefetch_fake(layer: int, slot: int) -> None:
    return None


@torch.library.register_fake(f"{NAMESPACE}::wait", lib=_lib)
def _wait_fake(layer: int, slot: int, caches: list[torch.Tensor], components: list[str]) -> list[torch.Tensor]:
    # The real outputs are contiguous views of the runtime's storage, whatever the inputs' strides.
    return [torch.empty(cache.shape, dtype=cache.dtype, device=cache.device) for cache in caches]


# torch 2.13 has no public effect registration for ops defined with `torch.library.Library`: the public
# route, `CustomOpDef.register_effect`, needs `torch.library.custom_op`, whose outputs may not alias
# inputs, and `wait` returns its inputs under `passthrough()`. Hence the private call, here only.
for _op in ("prefetch", "wait"):
    torch.library._register_effectful_op(f"{NAMESPACE}::{_op}", EffectType.ORDERED)

prefetch = torch.ops.kvpp.prefetch
wait = torch.ops.kvpp.wait

KVPP_OPS = (torch.ops.kvpp.prefetch, torch.ops.kvpp.wait)
_KVPP_TARGETS = frozenset(KVPP_OPS + (torch.ops.kvpp.prefetch.default, torch.ops.kvpp.wait.default))


def is_kvpp_op(target: object) -> bool:
    """True for both ops, as the packet (Dynamo graphs) or the overload (after AOT)."""
    try:
        return target in _KVPP_TARGETS
    except TypeError:  # an unhashable target
        return False
