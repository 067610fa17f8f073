"""Per-engine KVPP state inside a vLLM worker, and which engine is running right now.

Each model runner of an engine with KVPP on carries one `EngineState` (``runner._kvpp``); nothing is
shared between engines in a process. The compiled path's Dynamo backend finds the engine whose model
it compiles through `current_engine`, which the runner hooks set around every method that can run or
compile the model (dummy runs, steps, drafting).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpp_fx.config import KVPPConfig, Mode
from kvpp_fx.integrations.vllm.backends import owner_metadata

if TYPE_CHECKING:  # types only: this module is imported in vLLM's engine process, which imports no torch here
    from torch.distributed import ProcessGroup

    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.integrations.vllm.specs import VllmPlan
    from kvpp_fx.runtime.runtime import KVPPRuntime

logger = logging.getLogger(__name__)

_ENGINE: contextvars.ContextVar[EngineState | None] = contextvars.ContextVar("kvpp_vllm_engine", default=None)


WORKER_MODULE = "kvpp_fx.integrations.vllm.worker"
WORKER_PREFIX = "KVPPWorker__"


def hooked_worker_qualname(original: str) -> str:
    """The worker class name vLLM resolves to KVPP's subclass of `original` (idempotent)."""
    if original.startswith(f"{WORKER_MODULE}.{WORKER_PREFIX}"):
        return original
    if not original or "__" in original:
        raise KVPPHookError(f"KVPP cannot wrap vLLM worker class {original!r}.")
    return f"{WORKER_MODULE}.{WORKER_PREFIX}{original.replace('.', '__')}"


def wrapped_worker_qualname(hooked: str) -> str:
    return hooked.removeprefix(f"{WORKER_MODULE}.").removeprefix(WORKER_PREFIX).replace("__", ".")


class KVPPHookError(RuntimeError):
    """A vLLM hook KVPP needs cannot be applied to this vLLM version."""


def vllm_version() -> str:
    try:
        import vllm
        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown"


def hook_error(hook: str, why: str) -> KVPPHookError:
    from kvpp_fx.integrations.vllm.validation import SUPPORTED_VLLM

    return KVPPHookError(f"KVPP cannot hook {hook} on vLLM {vllm_version()} (kvpp-fx supports vLLM "
                         f"{SUPPORTED_VLLM}): {why}")


def require_methods(cls: type, methods: tuple[str, ...]) -> None:
    """Every method a hook overrides exists on `cls`, or `KVPPHookError` names the first missing one."""
    for method in methods:
        if not callable(getattr(cls, method, None)):
            raise hook_error(f"{cls.__module__}.{cls.__qualname__}.{method}", "the method does not exist.")


class KVPPAllocationError(RuntimeError):
    """After vLLM allocated its KV cache, attention would not read KVPP's views."""


@dataclass
class EngineState:
    config: KVPPConfig
    vllm_config: Any = field(repr=False)  # vLLM's VllmConfig
    runner_kind: str = ""  # "V1" or "V2": which of vLLM's model runners this engine's workers run
    vplan: VllmPlan | None = None  # from the loaded model's cache specs
    budget_blocks: int | None = None  # what determine_available_memory promised vLLM's planner
    runtime: KVPPRuntime | None = None
    group: ProcessGroup | None = None
    agreement_group: ProcessGroup | None = None  # gloo, same ranks: the runtime's per-forward agreement
    exchange_group: ProcessGroup | None = None  # same ranks, own communicator: owner-mode exchanges
    group_ranks: list[int] = field(default_factory=list)
    compiled_graphs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    awaited: set[int] = field(default_factory=set)  # eager hooks, per step
    device_api_factory: str | None = None  # "module:callable" (the tests' fault seam), None: the default
    mode: Mode = Mode.AUTO  # the runtime's mode for each step (additional_config.kvpp_mode; kvpp_set_mode)
    owner_blocker: str | None = None  # why decode rows cannot go to the owner here, or None
    compact_blocker: str | None = None  # why scratch slots here must hold whole layers, or None
    scratch_blocks: int | None = None  # S of the compact slots this worker plans, None: whole-layer slots
    scratch_choice: str = ""  # why this layout (`scratch.choose_plan`)
    metadata_layer: str | None = None  # a target MLA layer whose metadata names the step's decode rows
    steps: int = 0  # target-model forwards
    mixed_steps: int = 0  # forwards with decode rows and prefill rows
    skipped_cache_writes: int = 0  # layer writes a non-owner skipped (decode rows on the owner)
    packed_layers: int = 0  # non-owned layer forwards that read remapped metadata over a packed slot
    prefill_rows_with_history: int = 0  # rows whose prefill starts after computed tokens (a later chunk
    #                                     of a chunked prefill, or a prefix-cache hit)
    owner_calls: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # this step: vLLM's metadata -> the
    #                                     owner calls' (`backends.owner_metadata`), one per metadata object

    def owner_metadata(self, backend: str, metadata: Any) -> Any:
        """The metadata this step's owner calls read for vLLM's `metadata` (one per step and object)."""
        found = self.owner_calls.get(id(metadata))
        if found is None or found[0] is not metadata:
            found = self.owner_calls[id(metadata)] = (metadata, owner_metadata(backend, metadata))
        return found[1]

    def note_step(self, prefill_rows_with_history: int, mixed: bool = False) -> None:
        self.steps += 1
        self.mixed_steps += int(mixed)
        self.prefill_rows_with_history += prefill_rows_with_history

    @property
    def compact(self) -> bool:
        """Whether this engine's scratch slots hold S blocks rather than whole layers."""
        return self.plan is not None and self.plan.compact

    @property
    def plan(self) -> KVPPPlan | None:
        return None if self.vplan is None else self.vplan.plan

    @contextlib.contextmanager
    def active(self) -> Iterator[EngineState]:
        token = _ENGINE.set(self)
        try:
            yield self
        finally:
            _ENGINE.reset(token)


def current_engine() -> EngineState | None:
    return _ENGINE.get()
