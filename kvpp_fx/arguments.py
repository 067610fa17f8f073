"""Where a call passes an operand that an `AttentionOpSpec` declares: one addressing rule for the graph
passes (a node's ``args`` and ``kwargs``) and the runtime (a routed op's call).

Invariant: an operand is named by its position (``3``), its keyword (``"cache"``) or both
(``("cache", 3)``), and a call passes it by keyword when its ``kwargs`` hold that name, otherwise at its
position when the call has that many positional arguments, otherwise not at all. A bare keyword passed
positionally is found at its place among the op's parameter names, when the caller gives them
(``parameters``: the passes read them from the op's schema; a routed op's call has its operands already
located). Plain Python: every layer of the package may import it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

Operand = int | str | tuple[str, int]  # a position, a keyword, or (keyword, position)
Location = int | str  # where one call passes an operand: its position or its keyword


def locate(args: Sequence[Any], kwargs: Mapping[str, Any], operand: Operand,
           parameters: Sequence[str] = ()) -> Location | None:
    """Where this call passes `operand`; None when it does not pass it."""
    name, index = _name_and_index(operand)
    if name is not None and name in kwargs:
        return name
    if index is None and name in parameters:
        index = parameters.index(name)
    return index if index is not None and index < len(args) else None


def read_arg(args: Sequence[Any], kwargs: Mapping[str, Any], operand: Operand,
             parameters: Sequence[str] = ()) -> Any:
    """The value this call passes as `operand`; None when it does not pass it."""
    where = locate(args, kwargs, operand, parameters)
    if where is None:
        return None
    return kwargs[where] if isinstance(where, str) else args[where]


def write_arg(args: list[Any], kwargs: MutableMapping[str, Any], operand: Operand, value: Any,
              parameters: Sequence[str] = ()) -> None:
    """Pass `value` as `operand` in a call being built: where the call passes it, else by its keyword."""
    where = locate(args, kwargs, operand, parameters)
    if where is None:
        where, _ = _name_and_index(operand)
        if where is None:
            raise IndexError(f"the call has no positional argument {operand} to replace.")
    if isinstance(where, str):
        kwargs[where] = value
    else:
        args[where] = value


def _name_and_index(operand: Operand) -> tuple[str | None, int | None]:
    if isinstance(operand, tuple):
        return operand
    return (operand, None) if isinstance(operand, str) else (None, operand)
