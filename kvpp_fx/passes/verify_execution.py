"""The verifier's checks of how the registered ops run (`verify.CHECKS`): ``routing`` (owner mode, as
the route pass leaves it) and ``pieces`` (eagerly, outside the compiled pieces of a split).

Invariant: each check is a function of the `GraphFacts` alone that yields one message per problem.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpp_fx.arguments import read_arg
from kvpp_fx.ops import is_routed_op
from kvpp_fx.passes.registry import HeadSeparable, LayerResolutionError, OwnerLocal, RoutesItself, arg_location
from kvpp_fx.passes.verify_facts import GraphFacts, is_routed_wait, kvpp_kind


def check_routing(g: GraphFacts) -> Iterator[str]:
    routed_waits = [w for w in g.waits if is_routed_wait(w)]
    if not routed_waits and not any(is_routed_op(op.node.target) for op in g.registered):
        return
    if len(routed_waits) != len(g.waits):
        plain = [w.name for w in g.waits if not is_routed_wait(w)]
        yield f"waits {plain} are not routed while others are; owner mode is all or nothing per graph."
    owner_run = {op.node: op.layer for op in g.registered if is_routed_op(op.node.target)}
    for op in g.registered:
        node, spec, layer, target = op.node, op.spec, op.layer, op.node.target
        if isinstance(spec.owner, RoutesItself) and not is_routed_op(target):
            wait = g.wait_of.get(layer)
            if wait is not None and not is_routed_wait(wait):
                yield f"{node.name} routes its own owner rows but its layer's wait {wait.name} is not routed."
            continue
        if not is_routed_op(target):
            yield (f"{node.name} touches layer {layer}'s cache without routing in a routed graph; in owner mode it "
                   "would read a scratch slot that is not filled.")
            continue
        if target.layer != layer:
            yield f"{node.name} is routed for layer {target.layer} but touches layer {layer}."
        wait = g.wait_of.get(layer)
        if wait is not None and not is_routed_wait(wait):
            yield f"{node.name} is routed but its layer's wait {wait.name} is not."
        rule = spec.owner
        if isinstance(rule, OwnerLocal):
            if target.heads:
                yield f"{node.name} is routed as head-separable, but {spec.op} is declared OwnerLocal."
            for user in node.users:
                if owner_run.get(user) != layer:
                    yield (f"{user.name} reads the owner-local output of {node.name}, which is None on the ranks "
                           f"that do not own layer {layer}.")
                elif any(read_arg(user.args, user.kwargs, where) is node for where, _ in user.target.heads):
                    yield f"{user.name} takes the owner-local output of {node.name} as a head operand."
        elif isinstance(rule, HeadSeparable):
            try:
                declared = tuple((arg_location(node, o.arg), o.dim) for o in rule.operands)
            except LayerResolutionError as exc:
                yield f"{node.name}: {exc}"
                continue
            tokens = tuple(o.token_dim for o in rule.operands)
            if (target.heads, target.output_dim, target.output_like, target.token_dims, target.rows) != \
                    (declared, rule.output_dim, rule.output_like, tokens, rule.rows):
                yield (f"{node.name} is routed with heads {target.heads}, output dimension {target.output_dim}, "
                       f"output like {target.output_like}, token dimensions {target.token_dims}; {spec.op} "
                       f"declares {declared}, {rule.output_dim}, {rule.output_like}, {tokens}.")
        else:
            yield f"{node.name} is routed, but {spec.op} declares no owner rule."


def check_pieces(g: GraphFacts) -> Iterator[str]:
    for piece in g.pieces:
        if piece.is_eager:
            continue
        bad = [n.name for n in piece.graph_module.graph.nodes if kvpp_kind(n) or g.match(n) is not None]
        if bad:
            yield f"compiled piece {piece.name} contains kvpp or cache ops: {', '.join(bad)}."
