"""Deliberate faults shared by the end-to-end and pass tests (negative controls)."""


class DroppedBroadcast:
    """Fault: on a rank that does not own `layer`, its wait hands attention zeros instead of the
    broadcast bytes (as if the broadcast had been suppressed)."""

    def __init__(self, runtime, layer: int) -> None:
        self._runtime, self._layer = runtime, layer

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def wait(self, layer, slot, **kwargs):
        out = self._runtime.wait(layer, slot, **kwargs)
        if layer == self._layer and layer not in self._runtime.storage.persistent_layers:
            for view in self._runtime.typed_views(layer).values():
                view.zero_()
        return out
