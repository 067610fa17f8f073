"""Per-engine KVPP state inside a vLLM worker, and which engine is running right now.

Each model runner of an engine with KVPP on carries one `EngineState` (``runner._kvpp``); nothing is
shared between engines in a process. The compiled path's Dynamo backend finds the engine whose model
it compiles through `current_engine`, which the runner hooks set around every method that can run or
compile the model (dummy runs, steps, drafting).

An engine's state is split by lifetime, and each part has one writer:

- the configuration (`EngineState`'s own fields), fixed at construction (`worker`);
- `Layout`, the plan and its scratch slots, from the model, the budget and vLLM's cache config (`layout`);
- `AttentionChoices`, what the loaded model's attention allows and the steps' mode (`model_hooks`);
- `Communication`, the KVPP groups and the runtime (`allocation`);
- `StepState`, what a step builds for its layers, and `Counters`, what the stats report: written only
  through their own methods, as the step, the attention hooks and the owner calls all add to them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpp_fx.cache.cost import Mode
from kvpp_fx.integrations.vllm.attention.backends import owner_metadata
from kvpp_fx.integrations.vllm.setup.config import KVPPConfig
from kvpp_fx.runtime.current import active_runtime
from kvpp_fx.runtime.errors import OwnerRoutingError

if TYPE_CHECKING:  # types only: this module is imported in vLLM's engine process, which imports no torch here
    from torch.distributed import ProcessGroup

    from kvpp_fx.cache.placement import KVPPPlan
    from kvpp_fx.integrations.vllm.cache.specs import VllmPlan
    from kvpp_fx.runtime.runtime import KVPPRuntime
    from kvpp_fx.runtime.turn import LayerTurn

logger = logging.getLogger(__name__)

_ENGINE: contextvars.ContextVar[EngineState | None] = contextvars.ContextVar("kvpp_vllm_engine", default=None)


_HOOK_MARK = "_kvpp_fx_hook"
WORKER_MODULE = "kvpp_fx.integrations.vllm.engine.worker"
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
    from kvpp_fx.integrations.vllm.setup.validation import SUPPORTED_VLLM

    return KVPPHookError(f"KVPP cannot hook {hook} on vLLM {vllm_version()} (kvpp-fx supports vLLM "
                         f"{SUPPORTED_VLLM}): {why}")


def require_methods(cls: type, methods: tuple[str, ...]) -> None:
    """Every method a hook overrides exists on `cls`, or `KVPPHookError` names the first missing one."""
    for method in methods:
        if not callable(getattr(cls, method, None)):
            raise hook_error(f"{cls.__module__}.{cls.__qualname__}.{method}", "the method does not exist.")


def wrap_module_function(module_name: str, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace the function `name` of the vLLM module `module_name` by ``wrap(original)`` (idempotent):
    vLLM's code in that module, which calls it by its global name, then calls the wrapper. The wrapper
    delegates to `original` unless a KVPP runner is the caller."""
    module = importlib.import_module(module_name)
    original = getattr(module, name, None)
    if not callable(original):
        raise hook_error(f"{module_name}.{name}", "the function does not exist.")
    if getattr(original, _HOOK_MARK, False):
        return
    wrapper = functools.wraps(original)(wrap(original))
    setattr(wrapper, _HOOK_MARK, True)
    setattr(module, name, wrapper)


class KVPPAllocationError(RuntimeError):
    """After vLLM allocated its KV cache, attention would not read KVPP's views."""


@dataclass
class Layout:
    """The plan and its scratch slots: the loaded model's, then the budget's, then that of vLLM's KV cache
    config. Written by `layout`."""

    vplan: VllmPlan | None = None
    budget_blocks: int | None = None  # what determine_available_memory promised vLLM's planner
    scratch_blocks: int | None = None  # S of the compact slots this worker plans, None: whole-layer slots
    scratch_choice: str = ""  # why this layout (`scratch.choose_plan`)
    owner_only: bool = False  # compact slots that no step reads: every row goes to its owner (`scratch.owner_only`)


@dataclass
class AttentionChoices:
    """What the loaded model's attention allows, decided when the model loads, and the mode of the
    following steps (``additional_config.kvpp_mode``, then ``kvpp_set_mode``). Written by `model_hooks`."""

    mode: Mode = Mode.AUTO
    owner_blocker: str | None = None  # why decode rows cannot go to the owner here, or None
    compact_blocker: str | None = None  # why scratch slots here must hold whole layers, or None
    streams_history: bool = False  # every target MLA impl streams its prefill context from the owner
    owner_only_hazard: str | None = None  # why an SFA model's steps could not run on owner-only slots, or None
    metadata_layer: str | None = None  # a target MLA layer whose metadata names the step's decode rows


@dataclass
class Communication:
    """The KVPP groups, made once before vLLM measures memory, and the runtime over the allocated cache.
    Written by `allocation`."""

    group: ProcessGroup | None = None
    agreement_group: ProcessGroup | None = None  # gloo, same ranks: the runtime's per-forward agreement
    exchange_group: ProcessGroup | None = None  # same ranks, own communicator: owner-mode exchanges
    group_ranks: list[int] = field(default_factory=list)
    runtime: KVPPRuntime | None = None
    device_api_factory: str | None = None  # "module:callable" (the tests' fault seam), None: the default


@dataclass
class StepState:
    """What a target-model step builds for its layers, cleared when the next step opens (`begin`)."""

    awaited: set[int] = field(default_factory=set)  # layers the eager hooks waited for
    # the owner calls' metadata (`backends.owner_metadata`), by the id of vLLM's metadata object it is built from,
    # the call's heads and whether the layer's cache is fp8
    owner_calls: dict[tuple[int, int, bool], tuple[Any, Any]] = field(default_factory=dict)
    turn: LayerTurn | None = None  # the open layer's turn, as the step's forward handed it (`take_turn`)

    def begin(self) -> None:
        self.awaited.clear()
        self.owner_calls.clear()
        self.turn = None

    def take_turn(self, turn: LayerTurn | None) -> None:
        """The forward's listener: each layer's turn as its wait opens it (a graph's op or the eager hook);
        `step.step_forward` hands None when the forward closes."""
        self.turn = turn

    def first_wait(self, layer: int) -> bool:
        """Whether `layer` is waited for here: once per step, as the SFA indexer and the MLA attention of
        one layer share its wait."""
        if layer in self.awaited:
            return False
        self.awaited.add(layer)
        return True

    def owner_metadata(self, backend: str, metadata: Any, query_heads: int, fp8_cache: bool) -> Any:
        """The metadata this step's owner calls read for vLLM's `metadata` (one per step, object, head count and
        cache kind: vLLM may give layers with a bf16 and an fp8 cache one metadata object)."""
        key = (id(metadata), query_heads, fp8_cache)
        found = self.owner_calls.get(key)
        if found is None or found[0] is not metadata:
            found = self.owner_calls[key] = (metadata, owner_metadata(backend, metadata, query_heads, fp8_cache))
        return found[1]


@dataclass
class Counters:
    """What `stats.worker_stats` reports of the engine's work, counted as it happens."""

    steps: int = 0  # target-model forwards
    mixed_steps: int = 0  # forwards with decode rows and prefill rows
    prefill_rows_with_history: int = 0  # rows whose prefill starts after computed tokens (a later chunk
    #                                     of a chunked prefill, or a prefix-cache hit)
    skipped_cache_writes: int = 0  # layer writes a non-owner skipped (decode rows on the owner)
    skipped_indexers: int = 0  # SFA indexers a non-owner skipped (every row on the owner)
    packed_layers: int = 0  # non-owned layer forwards that read remapped metadata over a packed slot
    compiled_graphs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (kind, layers) of each

    def note_new_runtime(self) -> None:
        """The counts of steps' routes restart with each runtime, as its own stats do."""
        self.mixed_steps = self.skipped_cache_writes = self.skipped_indexers = self.packed_layers = 0

    def note_step(self, prefill_rows_with_history: int, mixed: bool) -> None:
        self.steps += 1
        self.mixed_steps += int(mixed)
        self.prefill_rows_with_history += prefill_rows_with_history

    def note_packed_layers(self, count: int) -> None:
        self.packed_layers += count

    def note_skipped_cache_write(self) -> None:
        self.skipped_cache_writes += 1

    def note_skipped_indexer(self) -> None:
        self.skipped_indexers += 1

    def note_compiled_graph(self, kind: str, layers: tuple[int, ...]) -> None:
        self.compiled_graphs.append((kind, layers))


@dataclass(frozen=True, eq=False)
class EngineState:
    """One engine's KVPP state: its configuration, fixed at construction, and one part per lifetime, each
    written by one module (or only through its own methods)."""

    config: KVPPConfig
    vllm_config: Any = field(repr=False)  # vLLM's VllmConfig
    runner_kind: str = ""  # "V1" or "V2": which of vLLM's model runners this engine's workers run
    layout: Layout = field(default_factory=Layout)
    attention: AttentionChoices = field(default_factory=AttentionChoices)
    comm: Communication = field(default_factory=Communication)
    step: StepState = field(default_factory=StepState)
    counters: Counters = field(default_factory=Counters)

    @property
    def vplan(self) -> VllmPlan | None:
        return self.layout.vplan

    @property
    def plan(self) -> KVPPPlan | None:
        return None if self.layout.vplan is None else self.layout.vplan.plan

    @property
    def compact(self) -> bool:
        """Whether this engine's scratch slots hold S blocks rather than whole layers."""
        return self.plan is not None and self.plan.compact

    @contextlib.contextmanager
    def active(self) -> Iterator[EngineState]:
        token = _ENGINE.set(self)
        try:
            yield self
        finally:
            _ENGINE.reset(token)


def current_engine() -> EngineState | None:
    return _ENGINE.get()


def open_runtime(state: EngineState) -> KVPPRuntime | None:
    """The engine's runtime while its step's forward is open on this thread; None otherwise (a dummy,
    profile or capture run, another engine's step, no step)."""
    runtime = active_runtime()
    return runtime if runtime is not None and runtime is state.comm.runtime else None


def open_turn(state: EngineState, layer: int) -> LayerTurn | None:
    """What a hook of target layer `layer` acts on: its turn, as the engine's forward handed it; None outside
    the engine's forward. A hook whose layer's turn is not the open one raises `OwnerRoutingError` (it would
    act on another layer's view or owner)."""
    if open_runtime(state) is None:
        return None
    turn = state.step.turn
    if turn is None or turn.layer != layer:
        raise OwnerRoutingError.outside_turn(layer, turn.layer if turn is not None else None)
    return turn
