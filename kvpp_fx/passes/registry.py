"""Registry of attention/cache ops the KVPP passes recognise.

Invariant: a node touches layer L's cache exactly when its target matches a registered
`AttentionOpSpec` and the spec reads L from the node. Matching is by qualified name, as vLLM's
``should_split`` matches splitting ops, so specs for vLLM's ops work without importing vLLM:
``"ns::op"`` matches the packet and every overload; ``"ns::op.overload"`` matches that overload (and
the packet when the overload is ``default``, since a Dynamo graph calls the packet).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

LAYER_NAME_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class LayerResolutionError(ValueError):
    """A registered op's layer could not be read from the node."""


@dataclass(frozen=True)
class CacheOperand:
    """Which argument of the op is a cache tensor, and which component of the layer's bundle it is."""

    arg: int | str | tuple[str, int]  # positional index, keyword name, or (name, index)
    component: str = "kv"


@dataclass(frozen=True)
class HeadOperand:
    """An operand that carries attention heads, split over the TP ranks along dimension ``dim``, and the
    step's query tokens along ``token_dim`` (owner mode checks those against the forward's load)."""

    arg: int | str | tuple[str, int]
    dim: int
    token_dim: int = 0


@dataclass(frozen=True)
class HeadSeparable:
    """The op computes every head on its own, so the layer's owner may run it over the heads of all
    ranks (owner mode): it gathers each `HeadOperand` from every rank, concatenates them along their
    head dimension in rank order, runs the op once, and sends each rank its part of the output, split
    along ``output_dim``. Every other operand must be identical on all ranks; the owner uses its own.
    """

    operands: tuple[HeadOperand, ...]
    output_dim: int
    output_like: int = 0  # the head operand whose shape and dtype the output has (the other ranks size
    #                       their part of the output by it)

    def __post_init__(self) -> None:
        if not self.operands:
            raise ValueError("HeadSeparable needs at least one head operand; an op without one is OwnerLocal.")
        if not 0 <= self.output_like < len(self.operands):
            raise ValueError(f"output_like {self.output_like} is not an index into the {len(self.operands)} "
                             "head operands.")


@dataclass(frozen=True)
class OwnerLocal:
    """In owner mode only the layer's owner runs the op, with its own operands: a cache write (the other
    ranks' scratch is not read in owner mode), or a computation over operands identical on every rank
    (SFA's indexer top-k: its queries are replicated over TP) whose output only the layer's other
    owner-run ops read. Elsewhere the op is skipped and its output is None.
    """


OwnerRule = HeadSeparable | OwnerLocal


@dataclass(frozen=True)
class AttentionOpSpec:
    """How to recognise one attention/cache op and read its layer and cache operands.

    ``layer_arg`` is a positional index or a keyword name (``(name, index)`` accepts either). With
    ``layer_kind="index"`` the argument is the layer's integer index; with ``layer_kind="name"`` it is
    a layer name (a string constant, or a placeholder whose example value carries the name, as vLLM's
    ``LayerName``), mapped to an index by the pass's name table or, failing that, by ``layers.N``.
    ``owner`` declares how the op runs in owner mode (`HeadSeparable` or `OwnerLocal`).
    """

    op: str
    layer_arg: int | str | tuple[str, int]
    layer_kind: str = "index"
    cache_operands: tuple[CacheOperand, ...] = ()
    owner: OwnerRule | None = None  # how owner mode runs it; None: the op's layer supports broadcast mode only

    def __post_init__(self) -> None:
        if "::" not in self.op:
            raise ValueError(f"op must be 'namespace::name' or 'namespace::name.overload', got {self.op!r}.")
        if self.layer_kind not in ("index", "name"):
            raise ValueError(f"layer_kind must be 'index' or 'name', got {self.layer_kind!r}.")
        if self.owner is not None and not isinstance(self.owner, (HeadSeparable, OwnerLocal)):
            raise ValueError(f"owner must be a HeadSeparable or an OwnerLocal, got {self.owner!r}.")

    def matches(self, target: Any) -> bool:
        return self.op in op_names(target)


def op_names(target: Any) -> set[str]:
    """Every name a spec may use for `target`: 'ns::op' and 'ns::op.overload' forms (for an op the KVPP
    pass routed, those of the op it wraps)."""
    target = getattr(target, "kvpp_routed_op", target)
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name  # "ns::op"
        return {base, f"{base}.{target._overloadname}"}
    if isinstance(target, torch._ops.OpOverloadPacket):
        return {target._qualified_op_name, f"{target._qualified_op_name}.default"}
    return set()


_REGISTRY: dict[str, AttentionOpSpec] = {}


def register_attention_op(spec: AttentionOpSpec, *, replace: bool = False) -> AttentionOpSpec:
    """Make the KVPP passes recognise `spec.op` (users may register their own)."""
    if spec.op in _REGISTRY and _REGISTRY[spec.op] != spec and not replace:
        raise ValueError(f"an AttentionOpSpec for {spec.op!r} is already registered; pass replace=True.")
    _REGISTRY[spec.op] = spec
    return spec


def unregister_attention_op(op: str) -> None:
    _REGISTRY.pop(op, None)


def registered_specs() -> tuple[AttentionOpSpec, ...]:
    return tuple(_REGISTRY.values())


class SpecLookup:
    """`find_spec` for a whole graph: the registry is read once and each distinct target matched once."""

    def __init__(self, specs: Iterable[AttentionOpSpec] | None = None) -> None:
        self.specs = tuple(registered_specs() if specs is None else specs)
        self._by_target: dict[Any, AttentionOpSpec | None] = {}

    def __call__(self, node: torch.fx.Node) -> AttentionOpSpec | None:
        if node.op != "call_function":
            return None
        target = node.target
        try:
            return self._by_target[target]
        except KeyError:
            names = op_names(target)
            found = next((spec for spec in self.specs if spec.op in names), None) if names else None
            self._by_target[target] = found
            return found
        except TypeError:  # an unhashable target is never a registered op
            return None


def find_spec(node: torch.fx.Node, specs: Iterable[AttentionOpSpec] | None = None) -> AttentionOpSpec | None:
    if node.op != "call_function":
        return None
    names = op_names(node.target)
    if not names:
        return None
    for spec in registered_specs() if specs is None else specs:
        if spec.op in names:
            return spec
    return None


def get_arg(node: torch.fx.Node, where: int | str | tuple[str, int]) -> Any:
    """An argument by keyword name or position; ``(name, index)`` tries the keyword first."""
    if isinstance(where, tuple):
        name, index = where
        if name in node.kwargs:
            return node.kwargs[name]
        where = index
    if isinstance(where, str):
        if where in node.kwargs:
            return node.kwargs[where]
        schema = getattr(node.target, "_schema", None)
        if schema is None and isinstance(node.target, torch._ops.OpOverloadPacket):
            schema = node.target.default._schema
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.name == where and i < len(node.args):
                    return node.args[i]
        raise LayerResolutionError(f"{node.format_node()} has no argument {where!r}.")
    if where < len(node.args):
        return node.args[where]
    raise LayerResolutionError(f"{node.format_node()} has no positional argument {where}.")


def arg_location(node: torch.fx.Node, where: int | str | tuple[str, int]) -> int | str:
    """Where a call passes an argument: its keyword name, or its position (see `get_arg`)."""
    get_arg(node, where)  # raises LayerResolutionError when the call does not pass it
    if isinstance(where, tuple):
        name, index = where
        return name if name in node.kwargs else index
    if isinstance(where, str) and where not in node.kwargs:
        schema = getattr(node.target, "_schema", None) or node.target.default._schema
        return next(i for i, a in enumerate(schema.arguments) if a.name == where)
    return where


def set_arg(node: torch.fx.Node, where: int | str | tuple[str, int], value: Any) -> None:
    if isinstance(where, tuple):
        name, index = where
        where = name if name in node.kwargs else index
    if isinstance(where, str) and where in node.kwargs:
        node.update_kwarg(where, value)
        return
    if isinstance(where, str):
        schema = getattr(node.target, "_schema", None) or node.target.default._schema
        where = next(i for i, a in enumerate(schema.arguments) if a.name == where)
    node.update_arg(where, value)


def literal_of(value: Any) -> Any:
    """A constant argument's value; for a placeholder, its example value (vLLM's LayerName)."""
    if isinstance(value, torch.fx.Node):
        example = value.meta.get("example_value", value.meta.get("val"))
        if example is None and "grapharg" in value.meta:
            example = getattr(value.meta["grapharg"], "example", None)
        if example is None:
            raise LayerResolutionError(f"cannot read a constant from node {value.name!r}.")
        value = example
    if isinstance(value, (int, str)):
        return value
    value = getattr(value, "real_obj", value)  # a FakeScriptObject wraps the opaque object Dynamo saw
    return getattr(value, "value", value)


def layer_of(node: torch.fx.Node, spec: AttentionOpSpec,
             name_to_index: Mapping[str, int] | Callable[[str], int] | None = None) -> tuple[int, str]:
    """(layer index, layer name) of a registered op's node."""
    raw = literal_of(get_arg(node, spec.layer_arg))
    if spec.layer_kind == "index":
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise LayerResolutionError(f"{node.format_node()}: layer argument is {raw!r}, expected an int.")
        return raw, f"layers.{raw}"
    name = str(raw)
    if callable(name_to_index):
        return int(name_to_index(name)), name
    if name_to_index is not None and name in name_to_index:
        return int(name_to_index[name]), name
    match = LAYER_NAME_PATTERN.search(name)
    if match is None:
        raise LayerResolutionError(f"cannot map layer name {name!r} to an index: give the pass a name table.")
    return int(match.group(1)), name


# vLLM's MLA/SFA ops (vllm/model_executor/layers/attention/mla_attention.py, sparse_attn_indexer.py).
VLLM_SPECS = (
    AttentionOpSpec("vllm::unified_mla_kv_cache_update", ("layer_name", 2), "name"),
    AttentionOpSpec("vllm::unified_mla_attention_with_output", ("layer_name", 4), "name"),
    AttentionOpSpec("vllm::sparse_attn_indexer", ("k_cache_prefix", 1), "name",
                    (CacheOperand(("kv_cache", 2), "indexer"),)),
)
for _spec in VLLM_SPECS:
    register_attention_op(_spec)
