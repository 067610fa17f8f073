"""Attention/cache op specs, and the one matcher that finds them in a graph.

Invariant: a node touches layer L's cache exactly when `OpMatcher` finds its target's
`AttentionOpSpec` among the configuration's specs and the spec reads L from the node. Matching is by
qualified name, as vLLM's ``should_split`` matches splitting ops, so specs for vLLM's ops work without
importing vLLM: ``"ns::op"`` matches the packet and every overload; ``"ns::op.overload"`` matches that
overload (and the packet when the overload is ``default``, since a Dynamo graph calls the packet).
When both forms are given, the overload's spec wins, for every pass and the verifier alike.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from kvpp_fx.arguments import Location, Operand, locate

LAYER_NAME_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class LayerResolutionError(ValueError):
    """A registered op's layer could not be read from the node."""


@dataclass(frozen=True)
class CacheOperand:
    """Which argument of the op is a cache tensor, and which component of the layer's bundle it is."""

    arg: Operand  # positional index, keyword name, or (name, index)
    component: str = "kv"


TABLE_KINDS = ("block_table", "slot_mapping")


@dataclass(frozen=True)
class TableOperand:
    """An argument that names blocks of the layer's cache: a block table (``[requests, blocks]`` of block
    ids, negative for none) or a slot mapping (one flat slot ``block * block_size + offset`` per new
    token, -1 for none). ``kvpp.wait`` rebinds it with the cache operands: a rank that reads the layer
    from a packed scratch slot reads it remapped to that slot."""

    arg: Operand
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in TABLE_KINDS:
            raise ValueError(f"a table operand's kind is one of {TABLE_KINDS}, got {self.kind!r}.")


@dataclass(frozen=True)
class HeadOperand:
    """An operand that carries attention heads, split over the TP ranks along dimension ``dim``, and the
    step's query tokens along ``token_dim`` (owner mode checks those against the forward's load)."""

    arg: Operand
    dim: int
    token_dim: int = 0


@dataclass(frozen=True)
class RowOperands:
    """How to cut a head-separable op's call into the rows of some of its requests, so that a hybrid
    forward runs one request's rows on the owner and another's locally: ``token_operands`` hold one row
    per query token on dimension 0 (the head operands are always among them), ``request_operands`` one
    row per request on dimension 0, and ``query_lens`` (one of them) each request's query tokens, in
    order. The output holds one row per query token on dimension 0. An operand not passed is skipped."""

    token_operands: tuple[Operand, ...]
    request_operands: tuple[Operand, ...]
    query_lens: Operand

    def __post_init__(self) -> None:
        if self.query_lens not in self.request_operands:
            raise ValueError(f"query_lens {self.query_lens!r} must be one of the request operands.")


@dataclass(frozen=True)
class HeadSeparable:
    """The op computes every head on its own, so the layer's owner may run it over the heads of all
    ranks (owner mode): it gathers each `HeadOperand` from every rank, concatenates them along their
    head dimension in rank order, runs the op once, and sends each rank its part of the output, split
    along ``output_dim``. Every other operand must be identical on all ranks; the owner uses its own.
    """

    operands: tuple[HeadOperand, ...]
    output_dim: int
    output_like: int = 0  # the head operand whose shape, dtype and strides the output has (as the op's
    #                       fake says; the other ranks build their part of the output by it)
    rows: RowOperands | None = None  # how to cut the call by request (hybrid forwards); None: it cannot be

    def __post_init__(self) -> None:
        if not self.operands:
            raise ValueError("HeadSeparable needs at least one head operand; an op without one is OwnerLocal.")
        if not 0 <= self.output_like < len(self.operands):
            raise ValueError(f"output_like {self.output_like} is not an index into the {len(self.operands)} "
                             "head operands.")
        if self.rows is not None:  # the rows are cut on dimension 0: every head operand holds its tokens there
            for operand in self.operands:
                if operand.arg not in self.rows.token_operands or operand.token_dim != 0:
                    raise ValueError(f"head operand {operand.arg!r} must be a token operand of rows= with its "
                                     "tokens on dimension 0 (token_dim=0): a hybrid forward cuts it by token.")


@dataclass(frozen=True)
class OwnerLocal:
    """In owner mode only the layer's owner runs the op, with its own operands: a cache write (the other
    ranks' scratch is not read in owner mode), or a computation over operands identical on every rank
    (SFA's indexer top-k: its queries are replicated over TP) whose output only the layer's other
    owner-run ops read. Elsewhere the op is skipped and its output is None.
    """


@dataclass(frozen=True)
class RoutesItself:
    """The op's own implementation sends the rows the forward routes to the layer's owner through
    its layer's turn's ``owner_compute`` (vLLM's MLA attention, whose decode rows a worker hook exchanges below
    the graph). The graph keeps the op as it is; its layer's wait is routed. The runtime checks, per
    layer, that a forward with owner rows did exchange them (`OwnerRoutingError` otherwise).
    """


OwnerRule = HeadSeparable | OwnerLocal | RoutesItself


@dataclass(frozen=True)
class AttentionOpSpec:
    """How to recognise one attention/cache op and read its layer and cache operands.

    ``layer_arg`` is a positional index or a keyword name (``(name, index)`` accepts either). With
    ``layer_kind="index"`` the argument is the layer's integer index; with ``layer_kind="name"`` it is
    a layer name (a string constant, or a placeholder whose example value carries the name, as vLLM's
    ``LayerName``), mapped to an index by the pass's name table or, failing that, by ``layers.N``.
    ``owner`` declares how the op runs in owner mode (`HeadSeparable`, `OwnerLocal` or `RoutesItself`).
    ``tables``: the op's block-table and slot-mapping operands (`TableOperand`), which the wait rebinds
    with the caches. ``remaps_itself``: the op reads its block ids from state the integration remaps
    for packed scratch slots itself (vLLM's per-layer metadata). An op with cache operands needs one of
    the two: on a rank that reads a packed slot, block ids of the pool would index the wrong blocks
    (`insert_checks.UnremappedTablesError`).
    """

    op: str
    layer_arg: Operand
    layer_kind: str = "index"
    cache_operands: tuple[CacheOperand, ...] = ()
    owner: OwnerRule | None = None  # how owner mode runs it; None: the op's layer supports broadcast mode only
    tables: tuple[TableOperand, ...] = ()
    remaps_itself: bool = False

    def __post_init__(self) -> None:
        if "::" not in self.op:
            raise ValueError(f"op must be 'namespace::name' or 'namespace::name.overload', got {self.op!r}.")
        if self.layer_kind not in ("index", "name"):
            raise ValueError(f"layer_kind must be 'index' or 'name', got {self.layer_kind!r}.")
        if self.owner is not None and not isinstance(self.owner, (HeadSeparable, OwnerLocal, RoutesItself)):
            raise ValueError(f"owner must be a HeadSeparable, an OwnerLocal or a RoutesItself, got {self.owner!r}.")


def op_names(target: Any) -> tuple[str, ...]:
    """The names a spec may use for `target`, most specific first: ``("ns::op.overload", "ns::op")``.
    The packet a Dynamo graph calls counts as its ``default`` overload; an op the route pass wrapped
    has the names of the op it wraps."""
    target = getattr(target, "kvpp_routed_op", target)
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name  # "ns::op"
        return f"{base}.{target._overloadname}", base
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name}.default", target._qualified_op_name
    return ()


class OpMatcher:
    """The spec of a node's target, by the one precedence rule that the passes, the verifier and the vLLM
    integration share: a spec that names the exact overload wins over one that names the op (the order
    of `op_names`), whatever order the specs come in. Each distinct target is resolved once."""

    def __init__(self, specs: Iterable[AttentionOpSpec]) -> None:
        self.by_name: dict[str, AttentionOpSpec] = {}
        for spec in specs:
            if self.by_name.setdefault(spec.op, spec) != spec:
                raise ValueError(f"two different AttentionOpSpecs for {spec.op!r}: {self.by_name[spec.op]} "
                                 f"and {spec}.")
        self._by_target: dict[Any, AttentionOpSpec | None] = {}

    def spec_for(self, target: Any) -> AttentionOpSpec | None:
        try:
            return self._by_target[target]
        except KeyError:
            found = next((self.by_name[name] for name in op_names(target) if name in self.by_name), None)
            self._by_target[target] = found
            return found
        except TypeError:  # an unhashable target is never a registered op
            return None

    def __call__(self, node: torch.fx.Node) -> AttentionOpSpec | None:
        return self.spec_for(node.target) if node.op == "call_function" else None


def parameter_names(target: Any) -> tuple[str, ...]:
    """The op's parameter names, in order, from its schema (the packet's: its default overload's); ()
    for a target without one. Cached per target: every registered op of a graph asks."""
    try:
        return _parameter_names(target)
    except TypeError:  # an unhashable target is never a registered op
        return ()


@functools.cache
def _parameter_names(target: Any) -> tuple[str, ...]:
    schema = getattr(target, "_schema", None)
    if schema is None and isinstance(target, torch._ops.OpOverloadPacket):
        schema = target.default._schema
    return tuple(argument.name for argument in schema.arguments) if schema is not None else ()


def arg_location(node: torch.fx.Node, where: Operand) -> Location:
    """Where the node's call passes an operand (`kvpp_fx.arguments.locate`): its keyword, or its position."""
    location = locate(node.args, node.kwargs, where, parameter_names(node.target))
    if location is None:
        what = f"argument {where!r}" if isinstance(where, str) else \
            f"positional argument {where[1] if isinstance(where, tuple) else where}"
        raise LayerResolutionError(f"{node.format_node()} has no {what}.")
    return location


def get_arg(node: torch.fx.Node, where: Operand) -> Any:
    """An operand of the node's call, by keyword name or position; ``(name, index)`` tries the keyword first."""
    location = arg_location(node, where)
    return node.kwargs[location] if isinstance(location, str) else node.args[location]


def set_arg(node: torch.fx.Node, where: Operand, value: Any) -> None:
    location = arg_location(node, where)
    if isinstance(location, str):
        node.update_kwarg(location, value)
    else:
        node.update_arg(location, value)


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
    return index_of_name(name, name_to_index), name


def index_of_name(name: str, name_to_index: Mapping[str, int] | Callable[[str], int] | None = None) -> int:
    """A layer name's index: from the name table when it holds the name, else from ``layers.N``."""
    if callable(name_to_index):
        return int(name_to_index(name))
    if name_to_index is not None and name in name_to_index:
        return int(name_to_index[name])
    match = LAYER_NAME_PATTERN.search(name)
    if match is None:
        raise LayerResolutionError(f"cannot map layer name {name!r} to an index: give the pass a name table.")
    return int(match.group(1))


def run_time_layer_input(node: torch.fx.Node, spec: AttentionOpSpec) -> torch.fx.Node | None:
    """The graph value a registered op reads its layer index from when that index is a run-time value
    (a SymInt: Dynamo made the index dynamic and compiled one graph for several layers), else None."""
    raw = get_arg(node, spec.layer_arg)
    if spec.layer_kind != "index" or not isinstance(raw, torch.fx.Node):
        return None
    value = raw.meta.get("val", raw.meta.get("example_value"))
    return raw if isinstance(value, torch.SymInt) else None


# vLLM's MLA/SFA ops (vllm/model_executor/layers/attention/mla_attention.py, sparse_attn_indexer.py).
VLLM_SPECS = (
    # The worker's MLA hook exchanges the decode rows of owner-mode forwards and skips the non-owners'
    # writes (`kvpp_fx.integrations.vllm.attention.owner_rows`); the SFA indexer declares nothing, so SFA graphs
    # stay broadcast-only. Their block ids come from the per-layer metadata the worker remaps for packed
    # slots (`kvpp_fx.integrations.vllm.attention.packed_metadata`).
    AttentionOpSpec("vllm::unified_mla_kv_cache_update", ("layer_name", 2), "name", owner=RoutesItself()),
    AttentionOpSpec("vllm::unified_mla_attention_with_output", ("layer_name", 4), "name", owner=RoutesItself()),
    AttentionOpSpec("vllm::sparse_attn_indexer", ("k_cache_prefix", 1), "name",
                    (CacheOperand(("kv_cache", 2), "indexer"),), remaps_itself=True),
)

# What `kvpp_backend(plan)` recognises when it is given no specs: vLLM's ops, and what
# `register_attention_op` added before the backend was built (a backend reads it once). No import adds
# to it: the reference ops' specs are data (`kvpp_fx.reference.ops.REFERENCE_SPECS`) given with specs=.
_DEFAULT_SPECS: dict[str, AttentionOpSpec] = {spec.op: spec for spec in VLLM_SPECS}


def register_attention_op(spec: AttentionOpSpec, *, replace: bool = False) -> AttentionOpSpec:
    """Add `spec` to the default specs of backends built from now on (a convenience: a backend given
    ``specs=`` uses those only)."""
    if spec.op in _DEFAULT_SPECS and _DEFAULT_SPECS[spec.op] != spec and not replace:
        raise ValueError(f"an AttentionOpSpec for {spec.op!r} is already registered; pass replace=True.")
    _DEFAULT_SPECS[spec.op] = spec
    return spec


def unregister_attention_op(op: str) -> None:
    _DEFAULT_SPECS.pop(op, None)


def default_specs() -> tuple[AttentionOpSpec, ...]:
    """The specs a backend built now without ``specs=`` uses."""
    return tuple(_DEFAULT_SPECS.values())
