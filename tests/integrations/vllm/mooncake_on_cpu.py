"""Test-only: vLLM's MooncakeConnector on a host without an accelerator.

``MooncakeConnectorWorker.__init__`` asks ``torch.accelerator.current_device_index()`` for the device its
sender threads bind to, which raises where there is no accelerator; CPU tensors need no device, so the
index is 0 there. Applied in every process of an engine whose environment sets `ENV` (the TP workers are
spawned and re-run the entry module, which imports this one).
"""

from __future__ import annotations

import os

ENV = "KVPP_TESTS_MOONCAKE_ON_CPU"


def apply() -> None:
    import torch

    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.current_device_index = lambda: 0


if os.environ.get(ENV):
    apply()
