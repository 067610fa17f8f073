"""Named errors of the KVPP runtime (hardening beyond the reference implementation)."""


class KVPPRuntimeError(RuntimeError):
    """Base class of every runtime protocol error."""


class NoActiveForwardError(KVPPRuntimeError):
    """A kvpp op ran outside ``runtime.forward(...)``."""


class NestedForwardError(KVPPRuntimeError):
    """``runtime.forward`` was entered while another forward is open."""


class UnknownLayerError(KVPPRuntimeError):
    """The layer is not a broadcast (target) layer of the plan."""


class SlotMismatchError(KVPPRuntimeError):
    """The slot in the graph differs from the plan's slot for that layer."""


class PrefetchPendingError(KVPPRuntimeError):
    """A prefetch was issued while another layer's prefetch had not been awaited."""


class SlotBusyError(PrefetchPendingError):
    """A prefetch reuses the scratch slot of the layer still pending."""


class PrefetchOrderError(KVPPRuntimeError):
    """Layers were prefetched out of the plan's execution order (ranks would desynchronise)."""


class WaitMismatchError(KVPPRuntimeError):
    """A wait asked for a layer other than the one pending."""


class TransferFailedError(KVPPRuntimeError):
    """A broadcast failed on the transfer thread; re-raised on the compute thread."""


class ForwardClosedError(KVPPRuntimeError):
    """The forward was closed by an earlier failure."""


class SkippedLayerError(KVPPRuntimeError):
    """A forward ended without awaiting every target layer."""
