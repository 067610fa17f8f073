"""The history faults of `faults`, counting what they did in the process that runs them: a negative control
then shows that its fault acted, not only that the tokens changed (`vllm_checks.fault_counts` reads the
counts from vLLM's workers).

``COUNTS[class name]``: ``history_chunks``, the prefill history chunks the runtime handed the fault's
``broadcast``; ``wrong_rank`` (`WrongRankHistory`), those it broadcast from another rank than the one the
runtime named; ``skipped`` (`SkippedHistory`), those it never issued. Both read the broadcast the fault
issued below it (`_Issued`), not the fault's own code.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from kvpp_fx.runtime.device import DeviceAPI
from tests.support import faults

COUNTS: defaultdict[str, Counter] = defaultdict(Counter)


class _Issued(DeviceAPI):
    """Just above `DeviceAPI` in a fault's method order: the source rank of the broadcast the fault issued
    (None: none issued)."""

    issued_from: int | None = None

    def broadcast(self, tensor, src, group):
        self.issued_from = src
        return super().broadcast(tensor, src, group)


class _Counted:
    """A history fault that counts, per chunk broadcast, whether it acted (`acted(src)`, named `what`); first
    in its method order, then the fault, then `_Issued`."""

    what = ""

    def acted(self, src) -> bool:
        raise NotImplementedError

    def broadcast(self, tensor, src, group):
        self.issued_from = None
        work = super().broadcast(tensor, src, group)
        if faults._history_chunk(tensor):
            counts = COUNTS[type(self).__name__]
            counts["history_chunks"] += 1
            counts[self.what] += self.acted(src)
        return work


class WrongRankHistory(_Counted, faults.WrongRankHistory, _Issued):
    """`faults.WrongRankHistory`, counted."""

    what = "wrong_rank"

    def acted(self, src) -> bool:
        return self.issued_from is not None and self.issued_from != src


class SkippedHistory(_Counted, faults.SkippedHistory, _Issued):
    """`faults.SkippedHistory`, counted."""

    what = "skipped"

    def acted(self, src) -> bool:
        return self.issued_from is None


class SwappedOwnerOutputs(DeviceAPI):
    """DeepSeek-V4's owner mode with one layer's outputs handed to the wrong ranks: the owner's scatter of the
    second target layer of each forward (of `LAYERS`) sends rank r the part of rank N-1-r. Counts its
    ``scatters`` (the owner's, with parts) and those it ``swapped``."""

    LAYERS = 4  # the tiny DeepSeek-V4's target layers, one exchange each per forward
    SWAPPED_POSITION = 1

    def __init__(self, device):
        super().__init__(device)
        self.calls = 0

    def scatter(self, tensor, scatter_list, src, group):
        position = self.calls % self.LAYERS
        self.calls += 1
        if scatter_list is not None:
            counts = COUNTS[type(self).__name__]
            counts["scatters"] += 1
            if self.SWAPPED_POSITION in (None, position):
                scatter_list = scatter_list[::-1]
                counts["swapped"] += 1
        return super().scatter(tensor, scatter_list, src, group)


class SwappedOwnerOutputsEveryLayer(SwappedOwnerOutputs):
    """`SwappedOwnerOutputs` on every layer."""

    SWAPPED_POSITION = None
