"""What a vLLM PIECEWISE deployment needs from kvpp-fx: the ops to split the graph at."""

from __future__ import annotations

from collections.abc import Iterable

KVPP_SPLITTING_OPS = ("kvpp::prefetch", "kvpp::wait")


def splitting_ops(existing: Iterable[str]) -> list[str]:
    """vLLM's ``compilation_config.splitting_ops`` plus the kvpp ops (kept in order, no duplicates).

    Next to the attention ops, the kvpp ops must run eagerly between compiled pieces: a compiled or
    CUDA-graph-captured piece would freeze the broadcast and the rebinding.
    """
    ops = list(existing)
    return ops + [op for op in KVPP_SPLITTING_OPS if op not in ops]
