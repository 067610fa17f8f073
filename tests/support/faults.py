"""Deliberate faults, entering the library only through its seam: a `DeviceAPI` subclass.

Each is the negative control of an equality test: with it the outputs must differ. A fault is given to
``KVPPRuntime.create(device_api=...)`` directly, or named ``"tests.support.faults:<callable>"`` (called
with the cache's device) where the runtime is built in another process: ``EngineConfig(device_api=...)``,
``generate(device_api=...)``, the vLLM workers' ``kvpp_set_device_api``.

A forward's collectives come in a fixed order, which the runtime's protocol enforces on every rank: one
agreement all-reduce, then the broadcasts of each target layer in plan order (with history, in broadcast
mode): one of the whole layer, or one per bundle component of its packed blocks, all out of one buffer
(the owner's bundle or its slot for the layer; consecutive layers never share one). So a fault counts
layers from the forward's agreement by the buffers the broadcasts read.
"""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from kvpp_fx.runtime.device import DeviceAPI


class _DoneWork:
    """The work handle of a collective that was never issued."""

    def wait(self, timeout=None) -> bool:
        return True


class UnremappedTables(DeviceAPI):
    """Receivers read a packed scratch slot through the tables as given: block ids of the pool where the
    slot holds positions in the step's packed list, so attention reads other blocks' bytes (or none)."""

    def remap_block_table(self, table, positions):
        return table

    def remap_slot_mapping(self, slots, positions, block_size, slot_blocks):
        return slots


class OffByOneRemap(DeviceAPI):
    """Every remapped block-table entry points one position further into the packed slot."""

    def remap_block_table(self, table, positions):
        remapped = super().remap_block_table(table, positions)
        return torch.where(remapped >= 0, remapped + 1, remapped)


class DroppedBroadcast(DeviceAPI):
    """The owner of the `position`-th target layer of every forward sends zeros instead of its bytes:
    whole layers as a zero buffer of the layer's size, packed blocks as zero blocks behind the true ids
    (so the receivers' id check passes). The owner's own view is untouched."""

    def __init__(self, device, position: int) -> None:
        super().__init__(device)
        self.position = position
        self._layer = -1  # the layer position of the last broadcast in this forward
        self._buffer = None  # the buffer the last broadcast read
        self._packed = False  # the faulty layer's blocks were packed as zeros
        self._zeros: list[torch.Tensor] = []  # what the faulty whole-layer broadcast sends

    def all_reduce_max(self, tensor, group):
        self._layer, self._buffer, self._packed = -1, None, False  # the agreement starts every forward
        self._zeros.clear()
        return super().all_reduce_max(tensor, group)

    def gather_blocks(self, source, ids, out) -> None:
        if self._layer + 1 == self.position:  # the owner packs the faulty layer's blocks, before its broadcasts
            out.zero_()
            self._packed = True
            return
        super().gather_blocks(source, ids, out)

    def broadcast(self, tensor, src, group):
        buffer = tensor.untyped_storage().data_ptr()
        if buffer != self._buffer:
            self._layer, self._buffer = self._layer + 1, buffer
            self._packed = self._packed and self._layer == self.position
        if self._layer == self.position and src == dist.get_rank() and not self._packed:  # a whole layer
            self._zeros.append(torch.zeros_like(tensor))
            return super().broadcast(self._zeros[-1], src, group)
        return super().broadcast(tensor, src, group)


def dropped_broadcast_of_layer_2(device) -> DroppedBroadcast:
    """`DroppedBroadcast` of the plan's third target layer (layer 2 of the reference presets)."""
    return DroppedBroadcast(device, position=2)


class DroppedBlock(DeviceAPI):
    """Owners leave the lowest listed block out of every packed broadcast: the first position of the
    receivers' slot keeps whatever it held before (another layer's bytes, where layers share the slot).
    The lowest block is the one requests sharing a prefix all read."""

    def gather_blocks(self, source, ids, out) -> None:
        super().gather_blocks(source, ids[1:], out[1:])


class SwappedHeads(DeviceAPI):
    """Owners scatter each rank the output heads of the next rank instead of its own."""

    def scatter(self, tensor, scatter_list, src, group):
        if scatter_list is not None:
            scatter_list = scatter_list[1:] + scatter_list[:1]
        return super().scatter(tensor, scatter_list, src, group)


class SkippedGather(DeviceAPI):
    """No owner-mode gather is issued on any rank: owners compute with their own queries in place of
    every other rank's."""

    def gather(self, tensor, gather_list, dst, group):
        for part in gather_list or ():
            part.copy_(tensor)
        return _DoneWork()


class UnwaitedBroadcasts(DeviceAPI):
    """The broadcasts are never waited for, so attention may read a slot before its bytes land."""

    def wait_work(self, work, timeout) -> None:
        return None


class FailingWait(DeviceAPI):
    """The `fail_at`-th wait for a collective's work (counting from 1) reports an error."""

    def __init__(self, device, fail_at: int) -> None:
        super().__init__(device)
        self.fail_at = fail_at
        self.calls = 0

    def wait_work(self, work, timeout) -> None:
        super().wait_work(work, timeout)
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError("injected transfer failure")


class SkewedBroadcasts(DeviceAPI):
    """Each broadcast is issued after a random sleep of up to `max_s` seconds, so ranks issue with a skew."""

    def __init__(self, device, max_s: float, seed: int) -> None:
        super().__init__(device)
        self.max_s = max_s
        self._rng = random.Random(seed)

    def broadcast(self, tensor, src, group):
        time.sleep(self._rng.uniform(0.0, self.max_s))
        return super().broadcast(tensor, src, group)



def _history_chunk(tensor) -> bool:
    """A prefill history chunk (`ContextRows`): the only broadcast of values; a slot's blocks travel as bytes."""
    return tensor.dtype.is_floating_point


class WrongRankHistory(DeviceAPI):
    """Every prefill history chunk is broadcast from the rank after the layer's owner, which gathered
    nothing: every rank attends over another rank's stale workspace."""

    def broadcast(self, tensor, src, group):
        if _history_chunk(tensor):
            ranks = dist.get_process_group_ranks(group)
            src = ranks[(ranks.index(src) + 1) % len(ranks)]
        return super().broadcast(tensor, src, group)


class SkippedHistory(DeviceAPI):
    """No prefill history chunk is broadcast: the owner's gather stays on the owner, and the other ranks
    attend over what their workspace held before."""

    def broadcast(self, tensor, src, group):
        if _history_chunk(tensor):
            return _DoneWork()
        return super().broadcast(tensor, src, group)


class FailingHistoryGather:
    """A prefill history chunk's gather (the ``gather`` given to `LayerTurn.stream_history`, which only the
    layer's owner calls) that raises, as vLLM's gather op would on the owner: the owner has nothing to
    broadcast, so the other ranks wait for the chunk in vain. Counts its calls."""

    MESSAGE = "injected history gather failure"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        raise RuntimeError(self.MESSAGE)


def dropped_broadcast_of_layer_1(device) -> DroppedBroadcast:
    """`DroppedBroadcast` of the plan's second target layer (the tiny DeepSeek-V3.2's layer 1)."""
    return DroppedBroadcast(device, position=1)
