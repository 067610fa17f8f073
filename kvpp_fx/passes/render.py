"""Graphs as short, stable text: for dumps, ``kvpp-fx graph`` and golden tests."""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable

import torch
import torch.fx

_PLACEHOLDER_ALIAS = re.compile(r"^\s+l_\w+ = L_\w+$")
_DELETIONS = re.compile(r";\s+[\w\s=]+= None$")
_ANNOTATION = re.compile(r" : [\w.]+")
_LIFTED = re.compile(r"\b[Ll]_self_(\w+?)_(?=\W|$)")
_PATH_TOKENS = re.compile(r"(?:^|_)(?:modules|parameters|buffers)_")


def _short_lifted(match: re.Match) -> str:
    return "self." + _PATH_TOKENS.sub(".", match.group(1)).strip(".").replace("._", ".")


def normalize_code(code: str) -> str:
    """``gm.code`` made reviewable: lifted parameter names shortened (``self.layers.0.q.weight``), type
    annotations, placeholder aliases, ``x = None`` deletions, provenance comments and blank lines dropped."""
    lines = []
    for line in code.splitlines():
        line = line.rstrip()
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or _PLACEHOLDER_ALIAS.match(line):
            continue
        line = _DELETIONS.sub("", line)
        if stripped.startswith("def "):
            line = _ANNOTATION.sub("", line)
        lines.append(_LIFTED.sub(_short_lifted, line))
    return "\n".join(lines)


def routed_rule(target) -> str:
    """A routed op's owner-mode rule: ``owner`` (owner-local) or ``heads 0@1,1@1->@1`` (head operands
    by position or keyword @ head dimension, -> the output's head dimension)."""
    if not target.heads:
        return "owner"
    operands = ",".join(f"{where}@{dim}" for where, dim in target.heads)
    return f"heads {operands}->@{target.output_dim}"


def target_name(node: torch.fx.Node) -> str:
    target = node.target
    wrapped = getattr(target, "kvpp_routed_op", None)
    if wrapped is not None:
        return f"routed[{routed_rule(target)}] {str(wrapped).removesuffix('.default')}"
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = str(target)
        return name.removesuffix(".default")
    if node.op == "call_method":
        return f".{target}"
    return getattr(target, "__name__", str(target))


def _fmt_arg(arg) -> str:
    if isinstance(arg, torch.fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_fmt_arg(a) for a in arg)
        return f"[{inner}]"
    return repr(arg)


def describe_node(node: torch.fx.Node) -> str:
    args = [_fmt_arg(a) for a in node.args] + [f"{k}={_fmt_arg(v)}" for k, v in node.kwargs.items()]
    return f"{target_name(node)}({', '.join(args)})"


def describe_pieces(pieces: Iterable) -> str:
    """One line per piece: eager pieces list their ops with arguments, compiled pieces their op names."""
    lines = []
    for piece in pieces:
        calls = [n for n in piece.graph_module.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        if piece.is_eager:
            body = "; ".join(describe_node(n) for n in calls if n.target is not operator.getitem)
        else:
            body = ", ".join(target_name(n) for n in calls if n.target is not operator.getitem)
        lines.append(f"{piece.name} [{piece.kind}]: {body}")
    return "\n".join(lines)
