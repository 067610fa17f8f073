"""Prefill history in vLLM's MLA: each context chunk streamed from the layer's owner into vLLM's workspace.

vLLM's MLA prefill reads a prefill row's history (a later chunk of a long prompt, a prefix-cache hit,
a speculative verification row that the backend runs as a prefill row, as CPU_MLA does) in bounded
chunks: ``MLACommonImpl._compute_prefill_context`` gathers each chunk of context out of the paged cache
into ``chunked_context.workspace`` with one of vLLM's gather ops, up-projects it with ``kv_b_proj`` and
merges the partial attentions by LSE. On an engine with compact scratch slots a prefill row's history
takes no position in the slot (`owner_rows.step_requests`). Instead, for each chunk of a target layer,
the layer's owner runs vLLM's own gather over its persistent cache and broadcasts the gathered rows
into every rank's workspace (`LayerTurn.stream_history`); the other ranks gather nothing. What follows
the gather runs as vLLM wrote it, on every rank.

How: the impl's ``_compute_prefill_context`` marks its call (`STREAMING` holds the layer's turn), and
vLLM's gather ops, wrapped where mla_attention calls them (attributes of ``vllm._custom_ops``), stream
instead of gathering while the mark is set. Unmarked, they are vLLM's own.

Prefetched: the marked call is the runtime's `ChunkPlan`. Once a chunk is in the workspace, the runtime
issues the next one into a buffer shaped like the workspace: this call's next chunk (vLLM's gather with
that chunk's fields of the same metadata), or after the last, the first chunk of the next target layer
(its own metadata, cache and scale, from the forward context), where the step allows it
(`step.history_ahead`). The gather of that chunk's call then finds it in flight, once its arguments but
the destination are equal to the ones it was gathered with; vLLM's workspace tensor then reads the
buffer's bytes (`Tensor.set_`: vLLM's loop cuts the chunk's rows out of the workspace after the gather
returns) and the runtime keeps the workspace's former bytes as its next buffer: two workspaces in turn,
nothing copied.

Invariants:
- Streaming runs in every forward of a compact-slot engine, and only there: a whole-layer slot holds the
  history, a compact one never does. A compact-slot forward that does not pack (none should carry a
  prefill row) raises `ContextStreamError` rather than read its slot.
- Every chunk of a marked call streams: the streamed chunks must number the metadata's chunks, else
  `ContextStreamError` (a gather KVPP does not wrap would have read a slot that does not hold the rows).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from kvpp_fx.integrations.vllm.engine.state import EngineState, open_turn, wrap_module_function
from kvpp_fx.runtime.context_rows import AheadChunk
from kvpp_fx.runtime.errors import ContextStreamError

OPS_MODULE = "vllm._custom_ops"


def _rows_up_to_num_tokens(arguments: dict[str, Any]) -> torch.Tensor:
    return arguments["dst"][: arguments["num_tokens"]]


def _all_rows(arguments: dict[str, Any]) -> torch.Tensor:
    return arguments["dst"]


# vLLM's context gathers in ``_compute_prefill_context`` and the rows of the destination each one fills:
# CPU's fallback and the fp8 ones are given ``workspace[:toks]``, the CUDA one the whole workspace.
GATHERS: dict[str, Callable[[dict[str, Any]], torch.Tensor]] = {
    "gather_mla_context_cache_cpu": _all_rows,
    "gather_and_maybe_dequant_cache": _rows_up_to_num_tokens,
    "cp_gather_cache": _all_rows,
    "cp_gather_and_upconvert_fp8_kv_cache": _all_rows,
}


# Each gather's arguments that differ from chunk to chunk, as a chunk of a layer's prefill metadata sets
# them (`_compute_prefill_context`); the destination is a buffer shaped like the workspace.
CHUNK_FIELDS: dict[str, Callable[[Any, Any, torch.Tensor], dict[str, Any]]] = {
    "gather_mla_context_cache_cpu": lambda prefill, chunk, into: {
        "dst": into[:chunk.num_context_tokens], "block_table": prefill.block_table[chunk.request_slice],
        "starts": chunk.starts, "cu_seq_lens": chunk.cu_seq_lens},
    "gather_and_maybe_dequant_cache": lambda prefill, chunk, into: {
        "dst": into, "block_table": prefill.block_table[chunk.request_slice], "cu_seq_lens": chunk.cu_seq_lens,
        "token_to_seq": chunk.token_to_seq, "num_tokens": chunk.num_context_tokens, "seq_starts": chunk.starts},
    "cp_gather_cache": lambda prefill, chunk, into: {
        "dst": into[:chunk.num_context_tokens], "block_table": prefill.block_table[chunk.request_slice],
        "cu_seq_lens": chunk.cu_seq_lens, "batch_size": chunk.num_requests, "seq_starts": chunk.starts},
    "cp_gather_and_upconvert_fp8_kv_cache": lambda prefill, chunk, into: {
        "dst": into[:chunk.num_context_tokens], "block_table": prefill.block_table[chunk.request_slice],
        "workspace_starts": chunk.cu_seq_lens, "batch_size": chunk.num_requests, "seq_starts": chunk.starts},
}


def _identity(value: Any) -> Any:
    """What a gather argument is, comparable across calls: a tensor by its memory and layout."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype, value.device)
    return value


def call_key(name: str, arguments: dict[str, Any]) -> tuple:
    """A gather call's arguments but its destination."""
    return (name, *((key, _identity(value)) for key, value in sorted(arguments.items()) if key != "dst"))


class ChunkStream:
    """One marked ``_compute_prefill_context`` call: the layer's turn, its prefill metadata, the chunks
    streamed so far and the current chunk's gather; the runtime's `ChunkPlan`."""

    __slots__ = ("turn", "impl", "prefill", "workspace", "streamed", "_call")

    def __init__(self, turn: Any, impl: Any, attn_metadata: Any) -> None:
        self.turn = turn
        self.impl = impl
        self.prefill = attn_metadata.prefill
        self.workspace = self.prefill.chunked_context.workspace
        self.streamed = 0
        self._call: tuple[str, Callable, dict[str, Any]] | None = None

    def stream(self, name: str, original: Callable, arguments: dict[str, Any], rows: torch.Tensor,
               gather: Callable[[], Any]) -> None:
        self.streamed += 1
        self._call = (name, original, arguments)
        self.turn.stream_history(rows, gather, self)

    def key(self) -> tuple:
        name, _, arguments = self._call
        return call_key(name, arguments)

    def adopt(self, buffer: torch.Tensor) -> torch.Tensor | None:
        workspace = self.workspace
        if (buffer.shape, buffer.stride(), buffer.dtype, buffer.device) != \
                (workspace.shape, workspace.stride(), workspace.dtype, workspace.device):
            return None
        former = torch.empty(0, dtype=workspace.dtype, device=workspace.device).set_(
            workspace.untyped_storage(), workspace.storage_offset(), workspace.shape, workspace.stride())
        workspace.set_(buffer.untyped_storage(), buffer.storage_offset(), buffer.shape, buffer.stride())
        return former

    def ahead(self, buffer: torch.Tensor, next_layer: int | None) -> AheadChunk | None:
        name, original, arguments = self._call
        chunks = self.prefill.chunked_context.chunks
        if self.streamed < len(chunks):
            layer, prefill, chunk, same = self.impl._kvpp_layer, self.prefill, chunks[self.streamed], {}
        elif next_layer is not None:
            found = _next_layer_call(self.impl, next_layer, arguments)
            if found is None:
                return None
            prefill, same = found
            layer, chunk = next_layer, prefill.chunked_context.chunks[0]
        else:
            return None
        fields = CHUNK_FIELDS[name](prefill, chunk, buffer)
        call = {**arguments, **same, **{key: value for key, value in fields.items() if key in arguments}}
        return AheadChunk(layer, call_key(name, call), GATHERS[name](call), lambda: original(**call))


def _next_layer_call(impl: Any, layer: int, arguments: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """The prefill metadata and the cache (and scale) with which `layer`'s own call will gather, from the
    forward context as that layer's attention reads them; None where that layer reads no chunked context.
    Decided from what every rank holds alike (the step's metadata, the model's layers), never from this
    rank's cache shapes (an owner's cache and a slot differ), so that every rank issues the same chunks."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    name = _layer_names(impl._kvpp_engine.vplan.layer_index).get(layer)
    metadata = context.attn_metadata
    metadata = metadata[0] if isinstance(metadata, list) else metadata
    metadata = metadata.get(name) if isinstance(metadata, dict) else None
    attention = context.no_compile_layers.get(name)
    chunked = getattr(getattr(metadata, "prefill", None), "chunked_context", None)
    cache = getattr(attention, "kv_cache", None)
    if chunked is None or not chunked.chunks or not isinstance(cache, torch.Tensor):
        return None
    source = arguments["src_cache"]
    same = {"src_cache": cache.view(source.dtype) if cache.dtype != source.dtype else cache}
    if "scale" in arguments:
        same["scale"] = attention._k_scale
    return metadata.prefill, same


_NAMES: dict[int, tuple[Any, dict[int, str]]] = {}  # id of a plan's layer_index -> (it, index -> name)


def _layer_names(layer_index: Any) -> dict[int, str]:
    """Each layer index's vLLM name (one target layer per index), built once per plan."""
    entry = _NAMES.get(id(layer_index))
    if entry is None or entry[0] is not layer_index:
        entry = _NAMES[id(layer_index)] = (layer_index, {index: name for name, index in layer_index.items()})
    return entry[1]


STREAMING: contextvars.ContextVar[ChunkStream | None] = contextvars.ContextVar("kvpp_context_stream", default=None)


def wrap_gathers() -> None:
    """vLLM's context gathers, streaming inside a marked call (idempotent)."""
    for name, rows_of in GATHERS.items():
        wrap_module_function(OPS_MODULE, name, functools.partial(_streaming_gather, name, rows_of))


def _streaming_gather(name: str, rows_of: Callable[[dict[str, Any]], torch.Tensor], original: Callable) -> Callable:
    signature = inspect.signature(original)
    names = frozenset(signature.parameters)

    def gather(*args: Any, **kwargs: Any) -> Any:
        stream = STREAMING.get()
        if stream is None:
            return original(*args, **kwargs)
        # mla_attention passes every argument by keyword; anything else is bound (and checked) first, on
        # every rank alike, since only the owner calls the gather itself
        arguments = kwargs
        if args or "dst" not in kwargs or not kwargs.keys() <= names:
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError as exc:
                raise ContextStreamError(f"vLLM's {name} was called with arguments KVPP does not read "
                                         f"({exc}).") from None
        stream.stream(name, original, arguments, rows_of(arguments), lambda: original(*args, **kwargs))
        return None

    return gather


@functools.cache
def streaming_impl_class(cls: type) -> type:
    """A subclass of an MLA impl class whose prefill context streams from each target layer's owner in a
    compact-slot engine's forwards."""

    def _compute_prefill_context(self, q: torch.Tensor, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Any,
                                 k_scale: Any) -> Any:
        engine: EngineState = self._kvpp_engine
        layer = self._kvpp_layer
        turn = open_turn(engine, layer) if engine.layout.scratch_blocks is not None else None
        if turn is None:
            return cls._compute_prefill_context(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale)
        if not turn.path.pack:
            raise ContextStreamError(
                f"layer {layer}: a prefill row reads history in a {turn.path.mode}-mode forward that packs "
                "nothing; its compact scratch slot does not hold that history.")
        chunks = len(attn_metadata.prefill.chunked_context.chunks)
        stream = ChunkStream(turn, self, attn_metadata)
        token = STREAMING.set(stream)
        try:
            result = cls._compute_prefill_context(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale)
        finally:
            STREAMING.reset(token)
        if stream.streamed != chunks:
            raise ContextStreamError(
                f"layer {layer}: {stream.streamed} of the prefill context's {chunks} chunks streamed from the "
                "owner; the others were read from a scratch slot that does not hold them.")
        return result

    return type(f"KVPPStreaming{cls.__name__}", (cls,),
                {"_compute_prefill_context": _compute_prefill_context, "__module__": __name__})


# The methods through which vLLM's MLA prefill reads history: an impl that overrides either reads it
# some other way (vLLM's dots3_note attention gathers in its own ``forward_mha``).
PREFILL_METHODS = ("forward_mha", "_compute_prefill_context")


def reads_history_through_vllms_chunks(impl_class: type) -> bool:
    """Whether `impl_class` reads prefill history only through ``MLACommonBaseImpl``'s chunked context."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl

    return issubclass(impl_class, MLACommonBaseImpl) and all(
        getattr(impl_class, name) is getattr(MLACommonBaseImpl, name) for name in PREFILL_METHODS)


def hook_impl(layer: Any) -> bool:
    """`layer`'s MLA impl (given its engine and layer by `owner_rows.hook_impl`) streams its prefill
    context; False where the impl reads its context some other way (its prefill history then needs a slot,
    and compact slots need a configuration in which no prefill row reads history)."""
    impl = layer.impl
    if not reads_history_through_vllms_chunks(type(impl)):
        return False
    impl.__class__ = streaming_impl_class(type(impl))
    return True
