"""Graph capture for pass tests: the Dynamo graphs a model compiles to, before any KVPP pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx


def capture_graphs(model: Callable, *args: Any, fullgraph: bool = True) -> list[torch.fx.GraphModule]:
    """Every graph Dynamo hands a backend while compiling and calling ``model(*args)`` once (Dynamo's
    state is reset first). A call that fails after the capture (a captured graph run over KVPP handles
    reads no bytes) still returns what was captured."""
    graphs: list[torch.fx.GraphModule] = []

    def grab(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=grab, fullgraph=fullgraph)
    try:
        compiled(*args)
    except Exception:
        if not graphs:
            raise
    return graphs


def capture_graph(model: Callable, *args: Any) -> torch.fx.GraphModule:
    """The one graph of a model compiled with ``fullgraph=True``."""
    (graph,) = capture_graphs(model, *args)
    return graph
