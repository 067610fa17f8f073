"""A target-model step of a KVPP engine: the runtime's forward around vLLM's model call.

Both model runners' adapters open `step_forward` inside vLLM's forward context (so the step's
attention metadata is readable) and around the model call only: drafting runs outside it, since MTP
layers are local and get no kvpp ops. The arguments come from the step's `StepBatch` (host arrays) and
the metadata, never from a device read:

- ``has_history``: any scheduled request with computed tokens (the seed's rule);
- with owner-capable MLA metadata, the step's requests (`owner_rows.step_requests`), each taking its
  path by the engine's mode (with compact slots, a prefill row's history streams from the owners
  instead, `context_stream`, and lists no block); else the union of the blocks holding history
  (`batch.active_blocks`) and of those the step fills (`batch.written_blocks`), so a packed slot gives
  each a position;
- whole layers where the metadata cannot be remapped to packed slots: micro-batched (DBO) steps, SFA
  models, and prefill context parallelism, whose metadata is each rank's part of the batch; for an SFA
  model whose sparse backend runs owner calls and routes every token as a decode row, with the engine's
  mode and the step's load, so its rows may all go to the owners instead, and always do with owner-only
  slots (`whole_layer_rows`).

Then, in a forward that packs blocks, non-owned layers read remapped metadata (`packed_metadata`), remapped
once per forward. The forward hands each layer's turn to the step's state as its wait opens it
(`StepState.take_turn`), and the attention hooks act on that turn (`state.open_turn`).
Every rank of a group opens the forward with the same arguments, derived from the same scheduler
output; the runtime's agreement checks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvpp_fx.cache.cost import OWNER, StepLoad
from kvpp_fx.integrations.vllm.attention import owner_rows, packed_metadata
from kvpp_fx.integrations.vllm.engine.batch import StepBatch, active_blocks, history_written_by_step, written_blocks
from kvpp_fx.integrations.vllm.cache.specs import INDEXER_COMPONENT
from kvpp_fx.integrations.vllm.engine.state import EngineState, KVPPAllocationError


@contextlib.contextmanager
def step_forward(state: EngineState, batch: StepBatch) -> Iterator[None]:
    runtime = state.comm.runtime
    if runtime is None:
        raise KVPPAllocationError("a step ran before KVPP allocated the KV cache.")
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    rows = step_rows(state, metadata, batch)
    state.counters.note_step(batch.prefill_rows_with_history, mixed=rows is not None and 0 < rows[1] < batch.num_reqs)
    state.step.begin()
    has_history, on_turn = batch.has_history, state.step.take_turn
    if not packs(state, metadata):  # whole layers: the step's metadata cannot be remapped to packed slots
        forward = runtime.forward(has_history=has_history, on_turn=on_turn, **whole_layer_rows(state, batch, rows))
    elif rows is None:  # no MLA metadata: every row reads its blocks by broadcast
        forward = runtime.forward(has_history=has_history, blocks=active_blocks(batch), written=written_blocks(batch),
                                  on_turn=on_turn)
    else:
        forward = runtime.forward(has_history=has_history, mode=state.attention.mode, requests=rows[0],
                                  history_ahead=history_ahead(state, batch, rows[1]), on_turn=on_turn)
    try:
        with forward:
            tables = runtime.packed_tables
            if tables is not None:
                # Non-owned layers read this forward's packed scratch slots through remapped tables.
                state.counters.note_packed_layers(packed_metadata.rebind(
                    get_forward_context(), tables, runtime, state.vplan.layer_index))
            yield
    finally:
        on_turn(None)  # a turn kept past its forward acts on nothing


def step_rows(state: EngineState, metadata, batch: StepBatch):
    """The step's requests and decode count from its MLA metadata (`owner_rows.step_requests`)."""
    choices = state.attention
    if choices.metadata_layer is None or metadata is None:
        return None
    streams = choices.streams_history and state.layout.scratch_blocks is not None
    return owner_rows.step_requests(metadata, choices.metadata_layer, batch,
                                    owner_capable=choices.owner_blocker is None, streams_history=streams)


def whole_layer_rows(state: EngineState, batch: StepBatch, rows) -> dict:
    """A step that sends whole layers, where every row of it may go to the owner instead (an SFA model on a
    sparse backend that runs owner calls, whose metadata routes every token as a decode row): the engine's
    mode and the step's load, so "owner" and "auto" can send all of its rows to the owners. Else nothing:
    whole layers. With owner-only slots (`scratch.owner_only`), which hold no layer, every step's rows go to
    the owners whatever the mode, and a step whose rows cannot is refused before anything moves."""
    owner_only = state.layout.owner_only
    if rows is None or state.attention.owner_blocker is not None or not rows[0] or rows[1] != batch.num_reqs:
        if owner_only:
            decode = "no MLA metadata" if rows is None else f"{rows[1]} of them decode rows in its metadata"
            raise owner_rows.OwnerRowsUnsupportedError(
                f"a step of {batch.num_reqs} requests ({decode}) cannot send every row to the layers' owners, and "
                "this engine's owner-only slots hold no layer to broadcast into: run this backend with "
                "kvpp_mode='broadcast' from the start (whole-layer slots).")
        return {}
    (group,) = rows[0]
    topk = getattr(state.vllm_config.model_config.hf_text_config, "index_topk", None)
    pairs = group.attention_pairs if topk is None else sparse_pairs(batch, int(topk))
    return {"mode": OWNER if owner_only else state.attention.mode, "load": StepLoad(group.query_tokens, pairs)}


def sparse_pairs(batch: StepBatch, topk: int) -> int:
    """The (query, key) pairs a step's sparse attention scores: `cost.scored_pairs` of every request, over the
    batch's arrays at once (host work per step stays a few array operations however many requests it has)."""
    history, query = batch.num_computed.astype(np.int64), batch.query_lens.astype(np.int64)
    full = np.clip(topk - history, 0, query)  # query tokens that score their whole causal context
    return int((full * history + full * (full + 1) // 2 + (query - full) * topk).sum())


def history_ahead(state: EngineState, batch: StepBatch, num_decodes: int) -> bool:
    """Whether a layer's first chunk of streamed history may be gathered before the step writes that
    layer's cache: the prefill rows stream their history, and none of it is written by this step."""
    streams = state.attention.streams_history and state.layout.scratch_blocks is not None
    return streams and not history_written_by_step(batch, num_decodes)


def packs(state: EngineState, metadata) -> bool:
    """Whether this step's non-owned layers can read packed slots: not with micro-batched (DBO) metadata,
    whose per-micro-batch slot mappings KVPP does not remap; not for SFA models, whose sparse and indexer
    metadata hold block tables `packed_metadata` does not remap; not under prefill context parallelism,
    whose metadata holds only this rank's part of the batch. Those steps send whole layers."""
    if state.config.pcp > 1:
        return False
    if INDEXER_COMPONENT in {c.name for layer in state.plan.spec.layers for c in layer.components}:
        return False
    return not isinstance(metadata, list)


def settled(state: EngineState, output: Any) -> Any:
    """`output` of the runner's ``sample_tokens``, once the runtime has read what the device checked in the
    step's forwards (`KVPPRuntime.settle`, up to this step's last forward): a step whose broadcast paired
    wrongly on any rank, or whose owner failed, raises its named error before vLLM hands its tokens on.
    vLLM waits for the device here anyway (its sampled tokens' copy to the host). An asynchronous output
    (async scheduling) is settled after vLLM's own wait in ``get_output``, which vLLM calls on the rank
    that hands the tokens on, in its output thread; each forward's flag holds every rank's checks. On
    CPU every check was read in the forward and nothing is left."""
    runtime = state.comm.runtime
    if runtime is None or not runtime.pending_checks:
        return output
    upto = runtime.forwards
    get_output = getattr(output, "get_output", None)
    if not callable(get_output):
        runtime.settle(upto)
        return output

    def get_settled_output() -> Any:
        result = get_output()
        runtime.settle(upto)
        return result

    output.get_output = get_settled_output
    return output
