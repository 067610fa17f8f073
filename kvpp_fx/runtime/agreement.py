"""The per-forward agreement: every rank of the group moves the same thing in a forward, or none does.

Ranks that pass different has_history, blocks, mode, load or history_ahead to ``runtime.forward`` would pair
collectives of different sizes or ids: gloo then accepts a short send silently or aborts the process.
So every forward of an enabled group starts with one all-reduce of its `AgreementKey`, bounded by the
timeout, issued when the forward begins (`Agreement.issue`) and checked (`PendingAgreement.check`) later:
- on CPU (gloo), just before the forward's first collective, since gloo aborts the process on a
  collective of another size: nothing moves before the ranks agreed;
- on a device, when the forward ends, before its results are used: the all-reduce runs on its host
  group while the device works, and the host never waits for it in between. Ranks that disagreed may
  have issued collectives that do not pair; they raise `BlockSetMismatchError` at the end, which then
  breaks the runtime (and a collective that never completes is the communicator's watchdog's).

The key travels as one fixed tensor of ``2 * len(key)`` int64 values, ``[key, -key]`` under MAX: afterwards the first
half is the group's maximum and the negated second half
its minimum, which are equal exactly when every rank has the same key. Ranks that disagree all raise
`BlockSetMismatchError`, and where nothing was issued before the check (always on CPU) the runtime stays
usable: the agreement itself kept the group in step.

The tensor is allocated once per runtime and its host side is an `array` the tensor shares memory
with, so a forward fills and reads it without building tensors.
"""

from __future__ import annotations

import array
import enum
import hashlib
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvpp_fx.cache.cost import HYBRID
from kvpp_fx.runtime.collectives import Collectives
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import BlockSetMismatchError


class ForwardPath(enum.IntEnum):
    """What a forward moves, as its agreement carries it."""

    NO_HISTORY = 0  # broadcast mode without history: nothing
    WHOLE_LAYERS = 1  # every layer's whole bundle
    ACTIVE_BLOCKS = 2  # the listed blocks of every layer
    OWNER = 3  # owner mode: queries to each layer's owner, outputs back
    HYBRID = 4  # some requests' rows to the owner, the listed blocks of the others broadcast


@dataclass(frozen=True)
class AgreementKey:
    """Everything the ranks must agree on before a forward moves anything."""

    path: ForwardPath
    block_count: int = 0  # active blocks only
    block_digest: int = 0  # of the sorted active-block ids
    query_tokens: int = -1  # of the forward's load, when given (owner mode gathers that many per rank)
    row_paths: int = 0  # which requests' rows go to the owner, when the forward names its requests
    history_ahead: int = 0  # 1: a layer's first streamed history chunk may be issued before its turn

    def values(self) -> tuple[int, int, int, int, int, int]:
        return (int(self.path), self.block_count, self.block_digest, self.query_tokens, self.row_paths,
                self.history_ahead)

    @classmethod
    def of(cls, path: Any, active: Any, history_ahead: bool = False) -> AgreementKey:
        """The key of a forward's chosen path (`path.ChosenPath`), its packed blocks (None: whole layers or
        nothing) and whether its history chunks stream ahead (a peer that differs would pair an owner's early
        chunk with another broadcast of the same size)."""
        return replace(cls._of_path(path, active), history_ahead=int(history_ahead))

    @classmethod
    def _of_path(cls, path: Any, active: Any) -> AgreementKey:
        query_tokens = path.load.query_tokens if path.load is not None else -1
        rows = _paths_digest(path.rows.modes) if path.rows is not None else 0
        if path.owner:
            return cls(ForwardPath.OWNER, query_tokens=query_tokens, row_paths=rows)
        if path.mode == HYBRID:
            if not path.has_history or active is None:  # no block, or whole layers
                return cls(ForwardPath.HYBRID, -1 if path.has_history else 0, 0, query_tokens, rows)
            return cls(ForwardPath.HYBRID, active.count, active.digest, query_tokens, rows)
        if not path.has_history:
            return cls(ForwardPath.NO_HISTORY, query_tokens=query_tokens)
        if active is None:
            return cls(ForwardPath.WHOLE_LAYERS, query_tokens=query_tokens, row_paths=rows)
        return cls(ForwardPath.ACTIVE_BLOCKS, active.count, active.digest, query_tokens, rows)


def _paths_digest(modes: tuple[str, ...]) -> int:
    """The requests' paths as one int64 for the agreement: which request went where, and how many."""
    return int.from_bytes(hashlib.blake2b(repr(modes).encode(), digest_size=8).digest(), "little") >> 2


_FIELD_NAMES = ("history and path (0 none, 1 whole layers, 2 active blocks, 3 owner mode, 4 hybrid)",
                "active-block count", "active-block set", "query tokens (the load)",
                "requests' paths (owner or broadcast)", "history ahead")
_WIDTH = len(_FIELD_NAMES)


class Agreement:
    """One runtime's agreement: the group it runs on, its fixed tensor, its timeout.

    ``group`` is a host-side (gloo) group of the KVPP group's ranks when one is given, so that on a
    device the agreement needs no host synchronisation; otherwise the KVPP group itself, on the cache's
    device, with the result copied back to the host.
    """

    def __init__(self, api: DeviceAPI, collectives: Collectives, group: Any, host_group: bool,
                 device: torch.device) -> None:
        self.api = api
        self.collectives = collectives
        self.group = group
        self._host = array.array("q", bytes(8 * 2 * _WIDTH))
        self._tensor = torch.frombuffer(self._host, dtype=torch.int64)
        self._device_copy = None if host_group or device.type == "cpu" else self._tensor.to(device)
        self.last_wait_s = 0.0  # how long the host waited for the last check (the cost on the critical path)

    def agree(self, key: AgreementKey) -> None:
        """Issue and check at once (`issue`, `PendingAgreement.check`)."""
        self.issue(key).check()

    def issue(self, key: AgreementKey) -> PendingAgreement:
        """Start the all-reduce of this rank's key; the caller checks it before it issues any other
        collective. Raises `TransferFailedError` when it cannot be issued (which breaks the runtime)."""
        mine = key.values()
        host = self._host
        host[:_WIDTH] = array.array("q", mine)
        host[_WIDTH:] = array.array("q", (-value for value in mine))
        tensor = self._tensor if self._device_copy is None else self._device_copy.copy_(self._tensor)
        try:
            work = self.api.all_reduce_max(tensor, self.group)
        except Exception as exc:
            raise self.collectives.not_issued(exc, "the forward's agreement") from exc
        return PendingAgreement(self, key, work)


class PendingAgreement:
    """An agreement in flight: the forward's host work goes on while the all-reduce runs."""

    __slots__ = ("agreement", "key", "work")

    def __init__(self, agreement: Agreement, key: AgreementKey, work: Any) -> None:
        self.agreement, self.key, self.work = agreement, key, work

    def check(self, late: bool = False) -> None:
        """Complete the all-reduce within the timeout; raises `BlockSetMismatchError` on every rank when
        the ranks' keys differ, or `TransferFailedError` when it fails or times out (which breaks the
        runtime)."""
        agreement, key = self.agreement, self.key
        start = time.perf_counter()
        try:
            agreement.collectives.complete_on_host(self.work, "the forward's agreement")
        finally:
            agreement.last_wait_s = time.perf_counter() - start
        if agreement._device_copy is not None:
            agreement._tensor.copy_(agreement._device_copy)
        host = agreement._host
        high, low = host[:_WIDTH].tolist(), host[_WIDTH:].tolist()
        differing = [name for name, h, l in zip(_FIELD_NAMES, high, low) if h != -l]
        if differing:
            raise BlockSetMismatchError(
                f"the ranks disagree on this forward's {', '.join(differing)}; every rank must pass the same "
                f"has_history, blocks, mode, load, requests and history_ahead to runtime.forward() (this rank: path "
                f"{int(key.path)}, {key.block_count} blocks). "
                + ("Checked when the forward ended (a device): its collectives may not have paired, and the "
                   "runtime is broken." if late else "Nothing was moved."))
