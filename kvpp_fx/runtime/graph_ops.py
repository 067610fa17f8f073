"""The kvpp ops' implementations and `RoutedOp`: what a rewritten graph calls at run time.

The schemas, fakes and effects are `kvpp_fx.ops` (what the compiler needs); this module registers the
implementations of ``kvpp::prefetch``, ``kvpp::wait`` and ``kvpp::enter_layer``, each calling the runtime
of the current ``runtime.forward(...)`` (`NoActiveForwardError` outside one, nothing in `passthrough`).

`RoutedOp` is the graph target the route pass puts in place of a registered cache op whose owner-mode
rule is declared (`kvpp_fx.backend` hands the pass this class): in broadcast mode it calls the op as it
is; in owner mode it runs the op on the layer's owner (over all ranks' heads, for a head-separable op)
and skips it elsewhere; in a hybrid forward it cuts the call by request.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from kvpp_fx import ops
from kvpp_fx.arguments import Location, read_arg, write_arg
from kvpp_fx.cache.cost import Mode
from kvpp_fx.runtime.current import active_runtime, current_runtime
from kvpp_fx.runtime.errors import OwnerRoutingError
from kvpp_fx.runtime.owner_exchange import HeadRule
from kvpp_fx.runtime.turn import LayerTurn
from kvpp_fx.schedule import ENTER_LAYER, NAMESPACE, PREFETCH, WAIT

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


def _check_lists(op: str, layer: int, caches: list, components: list, tables: list, kinds: list) -> None:
    if len(caches) != len(components):
        raise ValueError(f"{op} for layer {layer}: {len(caches)} caches but {len(components)} component names.")
    if len(tables) != len(kinds):
        raise ValueError(f"{op} for layer {layer}: {len(tables)} tables but {len(kinds)} table kinds.")


def _wait_impl(layer: int, slot: int, caches: list[torch.Tensor], components: list[str],
               routed: bool = False, tables: list[torch.Tensor] | None = None,
               table_kinds: list[str] | None = None) -> list[torch.Tensor]:
    tables, table_kinds = list(tables or ()), list(table_kinds or ())
    _check_lists("kvpp.wait", layer, caches, components, tables, table_kinds)
    if passing_through():
        return [*caches, *tables]
    turn = current_runtime().wait(layer, slot, routed=routed)
    return [*turn.views(caches, components, "kvpp.wait"), *turn.tables(tables, table_kinds)]


def _enter_layer_impl(layer: int, caches: list[torch.Tensor], components: list[str],
                      tables: list[torch.Tensor] | None = None,
                      table_kinds: list[str] | None = None) -> list[torch.Tensor]:
    tables, table_kinds = list(tables or ()), list(table_kinds or ())
    _check_lists("kvpp.enter_layer", layer, caches, components, tables, table_kinds)
    if passing_through():
        return [*caches, *tables]
    turn = current_runtime().enter_layer(layer)
    if turn is None:  # a local draft layer: the graph's caches and tables are its own
        return [*caches, *tables]
    return [*turn.views(caches, components, "kvpp.enter_layer"), *turn.tables(tables, table_kinds)]


_IMPL = torch.library.Library(NAMESPACE, "IMPL")
_IMPL.impl(PREFETCH, _prefetch_impl, "CompositeExplicitAutograd")
_IMPL.impl(WAIT, _wait_impl, "CompositeExplicitAutograd")
_IMPL.impl(ENTER_LAYER, _enter_layer_impl, "CompositeExplicitAutograd")


# --- owner mode: routed cache ops ------------------------------------------------------------------


class RoutedOp:
    """A registered cache op of one layer, routed so that the runtime's mode decides where it runs.

    ``heads``: (where, dim) of each head operand of a head-separable op, in declaration order; empty
    for an owner-local op; ``token_dims``: each head operand's query-token dimension.
    ``output_dim``: the head dimension of the output (head-separable ops).
    ``output_like``: the head operand whose shape and dtype the output has. ``rows``: the op's
    `RowOperands` (how its call cuts by request), which a hybrid forward needs. Instances are interned, so
    equal routings are the same graph target.
    """

    _interned: dict[tuple, RoutedOp] = {}

    def __new__(cls, op: object, layer: int, heads: tuple[tuple[Location, int], ...] = (),
                output_dim: int | None = None, output_like: int = 0,
                token_dims: tuple[int, ...] | None = None, rows: Any = None) -> RoutedOp:
        token_dims = tuple(token_dims) if token_dims is not None else (0,) * len(heads)
        if len(token_dims) != len(heads):
            raise ValueError(f"{len(heads)} head operands but {len(token_dims)} token dimensions.")
        key = (op, layer, tuple(heads), output_dim, output_like, token_dims, rows)
        routed = cls._interned.get(key)
        if routed is None:
            routed = super().__new__(cls)
            setattr(routed, ops.ROUTED_ATTRIBUTE, op)  # what the verifier reads (`ops.routed_op_of`)
            routed.layer = layer
            routed.heads = tuple(heads)
            routed.output_dim = output_dim
            routed.output_like = output_like
            routed.token_dims = token_dims
            routed.rows = rows
            routed.rule = HeadRule(routed.heads, token_dims, output_dim, output_like) if heads else None
            schema = getattr(op, "_schema", None) or op.default._schema
            routed._schema = schema
            name = schema.name.replace("::", "_")
            kind = "heads" if heads else "owner"
            routed.__name__ = routed.__qualname__ = f"routed_{kind}_{name}_L{layer}"
            routed.__module__ = __name__
            cls._interned[key] = routed
        return routed

    def __repr__(self) -> str:
        return (f"RoutedOp({self._schema.name}, layer={self.layer}, heads={self.heads}, "
                f"output_dim={self.output_dim})")

    def __reduce__(self):
        return RoutedOp, (self.kvpp_routed_op, self.layer, self.heads, self.output_dim, self.output_like,
                          self.token_dims, self.rows)

    def __call__(self, *args, **kwargs):
        op = self.kvpp_routed_op
        if passing_through() or _tracing_with_fake_tensors():
            return op(*args, **kwargs)
        runtime = current_runtime()
        if not runtime.path.exchanges:  # every row reads the cache here
            return op(*args, **kwargs)
        turn = runtime.open_turn
        if turn is None or turn.layer != self.layer:
            raise OwnerRoutingError.outside_turn(self.layer, turn.layer if turn is not None else None)
        if turn.path.hybrid:
            return self._hybrid(turn, args, kwargs)
        if not self.heads:
            return op(*args, **kwargs) if turn.owned else None
        return self._on_owner(turn, args, kwargs)

    def _on_owner(self, turn: LayerTurn, args: tuple, kwargs: dict) -> torch.Tensor:
        """Every row of the call on the layer's owner, over every rank's heads."""
        op = self.kvpp_routed_op
        tensors = [read_arg(args, kwargs, where) for where, _ in self.heads]

        def compute(full: list[torch.Tensor]) -> torch.Tensor:
            call_args, call_kwargs = list(args), dict(kwargs)
            for (where, _), tensor in zip(self.heads, full):
                write_arg(call_args, call_kwargs, where, tensor)
            return op(*call_args, **call_kwargs)

        return turn.owner_compute(self.rule, tensors, compute)

    def _hybrid(self, turn: LayerTurn, args: tuple, kwargs: dict) -> Any:
        """A hybrid forward: owner-local ops run on every rank (the broadcast rows read what they write);
        a head-separable op runs its owner requests' rows on the owner and the others' here."""
        op = self.kvpp_routed_op
        if not self.heads:
            return op(*args, **kwargs)
        if self.rows is None:
            raise OwnerRoutingError(
                f"{self._schema.name} of layer {self.layer} ran in a hybrid forward (requests on both paths), but "
                "its HeadSeparable declares no RowOperands, so its call cannot be cut by request. Declare rows=, "
                "or pass mode='broadcast' or 'owner'.")
        paths = turn.path.request_paths
        query_lens = read_arg(args, kwargs, self.rows.query_lens)
        lens = [int(n) for n in query_lens.tolist()]
        like = read_arg(args, kwargs, self.heads[self.output_like][0])
        if len(lens) != len(paths) or sum(lens) != like.shape[0]:
            raise OwnerRoutingError(
                f"{self._schema.name} of layer {self.layer}: the call holds {len(lens)} requests of {sum(lens)} "
                f"query tokens and {like.shape[0]} token rows; the forward names {len(paths)} requests. A hybrid "
                "forward cuts the call by request, so they must agree.")
        starts = [sum(lens[:k]) for k in range(len(lens))]
        owner = [k for k, path in enumerate(paths) if path == Mode.OWNER]
        local = [k for k, path in enumerate(paths) if path != Mode.OWNER]
        device = query_lens.device
        owner_tokens = torch.tensor([t for k in owner for t in range(starts[k], starts[k] + lens[k])],
                                    dtype=torch.long, device=device)
        local_tokens = torch.tensor([t for k in local for t in range(starts[k], starts[k] + lens[k])],
                                    dtype=torch.long, device=device)
        owner_part = self._on_owner(turn, *self._cut(args, kwargs, owner, owner_tokens, device))
        local_args, local_kwargs = self._cut(args, kwargs, local, local_tokens, device)
        local_part = op(*local_args, **local_kwargs)
        out = torch.empty_like(like)  # the op's output has the shape and strides of its head operand
        out[owner_tokens] = owner_part
        out[local_tokens] = local_part
        return out

    def _cut(self, args: tuple, kwargs: dict, requests: list[int], tokens: torch.Tensor,
             device: torch.device) -> tuple[tuple, dict]:
        call_args, call_kwargs = list(args), dict(kwargs)
        index = torch.tensor(requests, dtype=torch.long, device=device)
        for operands, rows in ((self.rows.token_operands, tokens), (self.rows.request_operands, index)):
            for where in operands:
                value = read_arg(args, kwargs, where)
                if isinstance(value, torch.Tensor):
                    write_arg(call_args, call_kwargs, where, value.index_select(0, rows))
        return tuple(call_args), call_kwargs


def _tracing_with_fake_tensors() -> bool:
    """A backend propagating shapes through the pieces (fake tensors) runs the op's fake kernel, as it
    does for the kvpp ops themselves; nothing is routed."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
