"""Named errors of the KVPP runtime (hardening beyond the reference implementation)."""

from __future__ import annotations


class KVPPRuntimeError(RuntimeError):
    """Base class of every runtime protocol error."""


class NoActiveForwardError(KVPPRuntimeError):
    """A kvpp op ran outside ``runtime.forward(...)``."""


class NestedForwardError(KVPPRuntimeError):
    """``runtime.forward`` was entered while another forward is open."""


class UnsupportedPlanError(KVPPRuntimeError):
    """The plan asks for something the runtime does not implement (e.g. sharded draft layers)."""


class InvalidBlocksError(KVPPRuntimeError, ValueError):
    """The active-block set passed to ``runtime.forward`` is not a set of block ids of the pool."""


class ScratchOverflowError(KVPPRuntimeError, ValueError):
    """A step's broadcast set does not fit in a compact scratch slot, and its rows cannot go to their
    owners; raised on every rank before anything moves."""


class BlockSetMismatchError(KVPPRuntimeError):
    """Ranks disagree on a forward's history or active-block set; the runtime breaks before moving bytes."""

    @classmethod
    def mispaired(cls, layer: int) -> BlockSetMismatchError:
        return cls(f"the block ids received with layer {layer}'s broadcast are not this forward's set: the broadcast "
                   "paired with another forward's or another rank's; this rank's view of the group can no longer be "
                   "trusted.")


class UnknownLayerError(KVPPRuntimeError):
    """The layer is not a broadcast (target) layer of the plan."""


class SlotMismatchError(KVPPRuntimeError):
    """The slot in the graph differs from the plan's slot for that layer."""


class PrefetchPendingError(KVPPRuntimeError):
    """A prefetch was issued while another layer's prefetch had not been awaited."""


class SlotBusyError(PrefetchPendingError):
    """A prefetch targets a scratch slot that a pending or the last awaited layer still uses."""


class PrefetchOrderError(KVPPRuntimeError):
    """Layers were prefetched out of the plan's execution order (ranks would desynchronise)."""


class SkippedLayerError(PrefetchOrderError):
    """A target layer was not prefetched and awaited in its turn (at a prefetch, or at forward exit)."""


class WaitMismatchError(KVPPRuntimeError):
    """A wait asked for a layer other than the one pending."""


class TransferFailedError(KVPPRuntimeError):
    """A broadcast failed; the runtime is broken from then on."""


class TransferTimeoutError(TransferFailedError):
    """A broadcast did not complete within the runtime's timeout (a dead or stalled peer)."""


class ForwardClosedError(KVPPRuntimeError):
    """The forward or the runtime can no longer be used."""


class KVPPRuntimeClosed(ForwardClosedError):
    """The runtime was closed."""


class RuntimeBrokenError(ForwardClosedError):
    """An earlier failure left the group's broadcast sequence unknown; the message names the first cause.

    Recovery: destroy the process group, create a new one and a new `KVPPRuntime` over it.
    """


class OwnerModeUnsupportedError(KVPPRuntimeError):
    """Owner mode was asked of a graph (or a layer) whose cache ops were not routed for it, or of a
    runtime without the attention shape the ``"auto"`` choice needs."""

    @classmethod
    def unrouted(cls, layer: int) -> OwnerModeUnsupportedError:
        return cls(f"a forward with owner rows reached layer {layer}, whose cache ops the graph does not route "
                   "for owner mode (an op without an owner rule in its AttentionOpSpec, or a graph rewritten before "
                   "owner mode); its attention would read a scratch slot that owner mode does not fill. Use "
                   'mode="broadcast", or declare the ops (HeadSeparable / OwnerLocal) and recompile.')


class OwnerRoutingError(KVPPRuntimeError):
    """A routed cache op ran outside its layer's turn, or its head operands do not split as declared."""

    @classmethod
    def outside_turn(cls, layer: int, open_layer: int | None) -> OwnerRoutingError:
        open_turn = f"layer {open_layer}'s" if open_layer is not None else "no layer's"
        return cls(f"an op of layer {layer} ran outside its turn ({open_turn} is open); it must follow its own "
                   "layer's wait (kvpp.wait, or the attention hook's), before the next layer's.")

    @classmethod
    def not_exchanged(cls, layer: int, owner_tokens: int) -> OwnerRoutingError:
        return cls(f"layer {layer}'s attention ran in a forward with {owner_tokens} owner rows without exchanging "
                   "them: its op read a scratch slot that does not hold those rows' blocks. The op must send its "
                   "owner rows through its turn's owner_compute (a RoutedOp, or an op declared RoutesItself whose "
                   "implementation does).")


class ContextStreamError(KVPPRuntimeError):
    """A prefill row's history was to stream from its layer's owner, and a chunk of it did not (or could
    not): attention would have read rows this rank does not hold."""


class UnlistedBlockError(KVPPRuntimeError):
    """A row of a non-owned layer's attention reads a block the forward's packed list does not hold (the
    host's lists and the device's tables disagree): it would read another block's bytes. On CPU raised
    where the tables are remapped; on a device read from the forward's checks one step later."""
