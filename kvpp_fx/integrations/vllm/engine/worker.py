"""KVPP inside vLLM's worker process: the worker subclass, and which model-runner adapter it applies.

Only engines with KVPP on reach this module. For them the plugin replaces
``parallel_config.worker_cls`` (the platform's worker, e.g. ``vllm.v1.worker.cpu_worker.CPUWorker``
or ``vllm.v1.worker.gpu_worker.Worker``) by ``kvpp_fx.integrations.vllm.engine.worker.KVPPWorker__<that
name, dots as __>``. vLLM resolves that name in its worker processes; this module then builds a
subclass of the platform's worker, and after ``init_device`` turns the worker's model runner into a
subclass of its own class: `runner_v2` for vLLM's V2 runner (its default wherever Triton runs),
`runner_v1` for V1. Both apply the same runner-agnostic parts:

- `layout`: ``determine_available_memory`` returns the logical budget of the chosen scratch layout, less
  what owner-mode exchanges hold at their peak; KVPP's communicators are made and used once before vLLM
  measures the memory (`allocation.connect`), so their buffers are inside vLLM's measurement;
- `allocation`: KVPP's allocator in place of vLLM's, and the post-allocation self-check;
- `step`: the runtime's forward around each target-model step;
- `model_hooks`: eager waits and owner rows on the loaded model;
- `stats`: ``worker_stats``.

Nothing else in the process changes, except the module attributes each adapter wraps, which delegate
to vLLM's unless a KVPP runner is the caller. Dummy, profile, warm-up and capture runs run the kvpp ops
in passthrough: the worker's ``determine_available_memory`` and ``compile_or_warm_up_model`` are
passthrough. The exception is V2's warm-up on a GPU, whose steps carry real requests and block ids: the V2
adapter runs them as KVPP steps (`runner_v2`). In mode 3 the worker makes vLLM build KVPP's
``VllmBackend`` (`compilation`).

What CPU runs and CUDA would run differently: the worker classes (``CPUWorker`` overrides
``determine_available_memory`` and ``compile_or_warm_up_model``); every hooked runner method is the
GPU runner's own on both, V1's and V2's.
"""

from __future__ import annotations

import functools
from typing import Any

from kvpp_fx.integrations.vllm.setup.config import KVPPConfig
from kvpp_fx.integrations.vllm.cache import allocation, layout
from kvpp_fx.integrations.vllm.engine import deepseek_v4, runner_v1, runner_v2
from kvpp_fx.integrations.vllm.attention.model_hooks import set_mode
from kvpp_fx.integrations.vllm.attention.compilation import install_vllm_backend
from kvpp_fx.integrations.vllm.engine.state import (
    WORKER_PREFIX,
    AttentionChoices,
    EngineState,
    KVPPHookError,
    current_engine,
    hook_error,
    hooked_worker_qualname,
    require_methods,
    wrapped_worker_qualname,
)
from kvpp_fx.integrations.vllm.engine.stats import worker_stats
from kvpp_fx.runtime.graph_ops import passthrough

__all__ = ["hooked_worker_qualname", "kvpp_worker_class", "kvpp_runner_class", "worker_stats", "current_engine",
           "KVPPHookError"]


def __getattr__(name: str) -> Any:
    if name.startswith(WORKER_PREFIX):
        from vllm.utils.import_utils import resolve_obj_by_qualname

        return kvpp_worker_class(resolve_obj_by_qualname(wrapped_worker_qualname(name)))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kvpp_runner_class(base: type) -> tuple[type, str]:
    """KVPP's subclass of a vLLM model runner class, and which runner it is ("V1" or "V2")."""
    if runner_v2.is_v2_runner(base):
        return runner_v2.kvpp_runner_v2_class(base), runner_v2.KIND
    if runner_v1.is_v1_runner(base):
        return runner_v1.kvpp_runner_v1_class(base), runner_v1.KIND
    raise hook_error(f"{base.__module__}.{base.__qualname__}",
                     "KVPP hooks vLLM's V1 and V2 GPUModelRunner classes and their subclasses.")


@functools.cache
def kvpp_worker_class(base: type) -> type:
    """KVPP's subclass of a vLLM worker class."""
    require_methods(base, ("init_device", "determine_available_memory", "load_model", "initialize_from_config",
                           "compile_or_warm_up_model"))

    class KVPPWorker(base):  # type: ignore[misc, valid-type]
        _kvpp_v4: deepseek_v4.DeepseekV4Engine | None = None

        def init_device(self) -> None:
            super().init_device()
            runner = getattr(self, "model_runner", None)
            if runner is None:
                raise hook_error(f"{base.__qualname__}.init_device", "the worker built no model_runner.")
            config = KVPPConfig.from_vllm_config(self.vllm_config)
            if deepseek_v4.is_deepseek_v4(self.vllm_config):
                # vLLM's runner stays as it is: KVPP acts inside DeepSeek-V4's attention and its allocation.
                self._kvpp_v4 = deepseek_v4.DeepseekV4Engine(config, self.vllm_config)
                v2 = runner_v2.is_v2_runner(type(runner))
                allocation.install_allocator(runner_v2.ALLOCATOR_MODULE if v2 else runner_v1.ALLOCATOR_MODULE)
                return
            runner.__class__, kind = kvpp_runner_class(type(runner))
            runner._kvpp = EngineState(config, self.vllm_config, runner_kind=kind,
                                       attention=AttentionChoices(mode=config.mode))
            if int(self.vllm_config.compilation_config.mode or 0) == 3:
                # Before load_model: vLLM builds its backend when it builds the model.
                install_vllm_backend()

        def load_model(self, *args: Any, **kwargs: Any) -> Any:
            result = super().load_model(*args, **kwargs)
            if self._kvpp_v4 is not None:
                self._kvpp_v4.hook_model(self.model_runner.get_model())
            return result

        def determine_available_memory(self) -> int:
            if self._kvpp_v4 is not None:
                self._kvpp_v4.connect(self.model_runner.device)
                return self._kvpp_v4.budget(self.model_runner, super().determine_available_memory())
            state: EngineState = self.model_runner._kvpp
            allocation.connect(state, self.model_runner.device)  # its buffers inside vLLM's measurement
            with state.active(), passthrough():
                available = super().determine_available_memory()
            return layout.budget(self.model_runner, state, available)

        def initialize_from_config(self, kv_cache_config: Any) -> Any:
            if self._kvpp_v4 is None:
                return super().initialize_from_config(kv_cache_config)
            with allocation.allocating_with(lambda config, _, vllm_allocate: self._kvpp_v4.allocate(config,
                                                                                                   vllm_allocate)):
                return super().initialize_from_config(kv_cache_config)

        def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
            if self._kvpp_v4 is not None:
                return super().compile_or_warm_up_model(*args, **kwargs)
            with self.model_runner._kvpp.active(), passthrough():
                return super().compile_or_warm_up_model(*args, **kwargs)

        # Reachable from a running server too (``POST /collective_rpc`` with VLLM_SERVER_DEV_MODE=1).
        def kvpp_stats(self) -> dict[str, Any] | None:
            return worker_stats(self)

        def kvpp_set_device_api(self, factory: str | None = None) -> None:
            """The tests' one seam into a worker (``collective_rpc("kvpp_set_device_api", args=(...,))``):
            rebuild this worker's runtime over the same cache with the `DeviceAPI` that `factory` (a
            ``"module:callable"`` name, called with the cache's device) returns; None restores the
            default. The tests pass fault-injecting device APIs from their own tree this way."""
            if self._kvpp_v4 is not None:
                return self._kvpp_v4.set_device_api(factory)
            allocation.set_device_api(self.model_runner._kvpp, factory)

        def kvpp_set_mode(self, mode: str) -> None:
            """Set the mode of the following steps ("broadcast", "owner" or "auto"), as
            ``additional_config.kvpp_mode`` sets it at start (``collective_rpc``: every worker at once)."""
            set_mode(self.model_runner._kvpp, mode)

    KVPPWorker.__name__ = f"KVPP{base.__name__}"
    KVPPWorker.__qualname__ = WORKER_PREFIX + f"{base.__module__}.{base.__qualname__}".replace(".", "__")
    return KVPPWorker
