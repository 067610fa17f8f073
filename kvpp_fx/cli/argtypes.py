"""argparse value types of the command-line entry points (`kvpp_fx.cli`, `kvpp_fx.cli.demo`).

A leaf module: it imports nothing from kvpp_fx, so both entry points take their types from here without
importing each other.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def number_type(kind: Callable[[str], T], ok: Callable[[T], bool], wanted: str) -> Callable[[str], T]:
    """An argparse type: `kind(text)` that satisfies `ok`, else a one-line error naming `wanted`."""
    def parse(text: str) -> T:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


positive_int = number_type(int, lambda v: v >= 1, "a positive integer")
non_negative_int = number_type(int, lambda v: v >= 0, "a non-negative integer")
positive_float = number_type(float, lambda v: 0 < v < float("inf"), "a positive number")
non_negative_float = number_type(float, lambda v: 0 <= v < float("inf"), "a non-negative number")
fraction = number_type(float, lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]")
