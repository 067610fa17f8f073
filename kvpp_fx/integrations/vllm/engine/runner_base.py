"""What the V1 and V2 model-runner adapters (`runner_v1`, `runner_v2`) share: the check of vLLM's runner
class with the allocator's wrapping (`prepare_hooks`), and the hooks both runners take alike
(`KVPPRunnerBase`).

A KVPP runner class lists `KVPPRunnerBase` first among its bases and vLLM's runner class after it, so the
``super()`` of each shared hook is vLLM's method.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvpp_fx.integrations.vllm.cache import allocation
from kvpp_fx.integrations.vllm.attention.model_hooks import prepare_model
from kvpp_fx.integrations.vllm.engine.state import EngineState, hook_error, require_methods
from kvpp_fx.integrations.vllm.engine.step import settled
from kvpp_fx.runtime.graph_ops import passthrough


def is_runner(cls: type, runner_module: str) -> bool:
    """Whether `cls` is the ``GPUModelRunner`` of the vLLM module `runner_module` or a subclass (its CPU
    runner is one)."""
    return issubclass(cls, importlib.import_module(runner_module).GPUModelRunner)


def prepare_hooks(base: type, kind: str, runner_module: str, hooks: tuple[str, ...], allocator_module: str) -> None:
    """Check that `base` is vLLM's `kind` model runner with every method in `hooks`, then wrap vLLM's
    ``allocate_kv_cache`` where that runner calls it (in `allocator_module`)."""
    if not is_runner(base, runner_module):
        raise hook_error(f"{base.__module__}.{base.__qualname__}",
                         f"it is not vLLM's {kind} GPUModelRunner or a subclass.")
    require_methods(base, hooks)
    allocation.install_allocator(allocator_module)


class KVPPRunnerBase:
    """The hooks V1's and V2's runners take alike, in the order a runner calls them."""

    _kvpp: EngineState
    kv_caches: list[Any]

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)  # type: ignore[misc]
        prepare_model(self, self._kvpp)
        return result

    def _dummy_run(self, *args: Any, **kwargs: Any) -> Any:
        with self._kvpp.active(), passthrough():
            return super()._dummy_run(*args, **kwargs)  # type: ignore[misc]

    def _kvpp_copy_on_persistent_views(self, update: Callable[[Any], Any], scheduler_output: Any) -> Any:
        """vLLM's `update` of the runner's requests, whose copy-on-write indexes the caches by pool block
        id: with compact slots, over the persistent views only."""
        if not (self._kvpp.compact and getattr(scheduler_output, "kv_cache_block_copies", None)):
            return update(scheduler_output)
        every = self.kv_caches
        self.kv_caches = allocation.persistent_views(self._kvpp)
        try:
            return update(scheduler_output)
        finally:
            self.kv_caches = every

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        with self._kvpp.active():
            return settled(self._kvpp, super().sample_tokens(*args, **kwargs))  # type: ignore[misc]
