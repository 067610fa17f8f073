"""Owner mode in the runtime on real gloo ranks, without a model: results, refusals and failures.

The rank functions call the runtime's ops as a routed graph calls them: the schedule's waits with
``routed=True``, and `RoutedOp`s of the reference attention and cache-write ops in each layer's turn.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import kvpp_fx.reference.ops  # noqa: F401  (defines the kvpp_ref ops)
from kvpp_fx.cache.cost import AttentionShape, StepLoad
from kvpp_fx.runtime.graph_ops import RoutedOp
from kvpp_fx.runtime import errors as E
from kvpp_fx.runtime.device import DeferredRead, DeviceAPI
from tests.support.launch import fresh_group, launch
from tests.support.specs import TOY_WIDTH
from tests.support.toy_runtime import pattern, run_layers, toy_runtime, write_owned

pytestmark = pytest.mark.multirank

HEADS_PER_RANK, ROPE = 2, 2
RANK_WIDTH = TOY_WIDTH - ROPE
SCALE = 0.3
ATTENTION = torch.ops.kvpp_ref.mla_attention.default


def routed_attention(layer: int) -> RoutedOp:
    return RoutedOp(ATTENTION, layer, ((0, 1), (1, 1)), 1)


def queries(rank: int, layer: int, tokens: int = 3):
    gen = torch.Generator().manual_seed(1000 * rank + layer)
    return (torch.randn(tokens, HEADS_PER_RANK, RANK_WIDTH, generator=gen),
            torch.randn(tokens, HEADS_PER_RANK, ROPE, generator=gen))


def metadata():
    """Two requests over the toy pool: 9 context tokens (2 new) and 5 (1 new)."""
    table = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0]], dtype=torch.int32)
    return table, torch.tensor([9, 5]), torch.tensor([2, 1])


def attention_shape(world: int) -> AttentionShape:
    return AttentionShape(HEADS_PER_RANK * world, TOY_WIDTH, RANK_WIDTH, 4)


def owner_runtime(world: int, timeout_s: float = 20.0, **create):
    return toy_runtime(fresh_group(world, timeout_s), 4, **create)


def owner_forward(rt, *, attend, mode="owner", routed=True, tokens: int = 3):
    with rt.forward(True, mode=mode, load=StepLoad(tokens, 14 * tokens)):
        run_layers(rt, attend, routed=routed)


# --- results and refusals -------------------------------------------------------------------------------

def owner_protocol_ranks(rank: int, world: int):
    """Owner-mode results against local attention over the owner's bytes, and the named refusals."""
    out = {}
    shape = attention_shape(world)
    rt = owner_runtime(world, attention=shape)
    table, seq_lens, query_lens = metadata()

    # 1. each rank gets exactly the attention of its own heads over the owner's cache
    write_owned(rt, 1)
    results = {}

    def attend(layer, view):
        q_latent, q_pe = queries(rank, layer)
        results[layer] = routed_attention(layer)(q_latent, q_pe, rt.typed_views(layer)["kv"], table, seq_lens,
                                                 query_lens, SCALE, layer)

    owner_forward(rt, attend=attend)
    out["exact"] = all(torch.equal(results[layer], ATTENTION(*queries(rank, layer), pattern(1, layer), table,
                                                             seq_lens, query_lens, SCALE, layer))
                       for layer in rt.plan.target_layers)
    last = rt.last_forward()
    out["last"] = {k: last[k] for k in ("mode", "broadcasts", "exchanges", "bytes")}

    # 1b. non-contiguous head operands: this rank's part of the output has the strides the op's fake gives
    # it (those of its head operand), which inductor checks at every call; the values are those above
    strided = {}

    def attend_strided(layer, view):
        q_latent, q_pe = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in queries(rank, layer))
        part = routed_attention(layer)(q_latent, q_pe, rt.typed_views(layer)["kv"], table, seq_lens, query_lens,
                                       SCALE, layer)
        strided[layer] = (part.stride() == torch.empty_like(q_latent).stride() != part.contiguous().stride(),
                          torch.equal(part, results[layer]))

    owner_forward(rt, attend=attend_strided)
    out["strides"] = strided

    # 2. a graph that is not routed is refused at its first wait, before any byte moves
    try:
        owner_forward(rt, attend=lambda layer, view: None, routed=False)
        out["unrouted"] = None
    except E.OwnerModeUnsupportedError as exc:
        out["unrouted"] = str(exc)
    out["broken_after_unrouted"] = rt.broken is not None
    owner_forward(rt, attend=lambda layer, view: None, mode="broadcast", routed=True)  # still usable

    # 3. a routed op outside its layer's turn
    def early(layer, view):
        if layer == rt.plan.target_layers[0]:
            routed_attention(layer + 1)(*queries(rank, layer), rt.typed_views(layer)["kv"], table, seq_lens,
                                        query_lens, SCALE, layer + 1)

    try:
        owner_forward(rt, attend=early)
        out["outside_turn"] = None
    except E.OwnerRoutingError as exc:
        out["outside_turn"] = str(exc)

    # 4. "auto" and "owner" need the step's load; a runtime without an attention shape cannot choose
    for mode in ("auto", "owner"):
        try:
            with rt.forward(True, mode=mode):
                pass
            out[f"{mode}_without_load"] = None
        except E.OwnerModeUnsupportedError as exc:
            out[f"{mode}_without_load"] = str(exc)
    bare = owner_runtime(world)
    try:
        with bare.forward(True, mode="auto", load=StepLoad(1, 10)):
            pass
        out["auto_without_shape"] = None
    except E.OwnerModeUnsupportedError as exc:
        out["auto_without_shape"] = str(exc)

    # 5. ranks that disagree on the mode fail together before anything moves
    other = owner_runtime(world, attention=shape)
    try:
        with other.forward(True, mode="owner" if rank == 0 else "broadcast", load=StepLoad(3, 30)):
            pass
        out["mismatch"] = None
    except E.BlockSetMismatchError as exc:
        out["mismatch"] = str(exc)
    try:  # owner mode gathers each rank's query tokens: ranks that disagree on them fail before any gather
        with other.forward(True, mode="owner", load=StepLoad(3 + rank, 10)):
            pass
        out["load_mismatch"] = None
    except E.BlockSetMismatchError as exc:
        out["load_mismatch"] = str(exc)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_owner_mode_results_and_refusals(world):
    results = launch(owner_protocol_ranks, world)
    heads, tokens = HEADS_PER_RANK, 3
    part = tokens * heads * (TOY_WIDTH + RANK_WIDTH) * 4  # q in + output back, fp32
    layers = 4
    for rank, res in enumerate(results):
        assert res["exact"], f"rank {rank}: owner-mode attention differs from local attention over the owner's bytes"
        assert res["strides"] == dict.fromkeys(range(layers), (True, True)), (rank, res["strides"])
        owned = layers // world
        assert res["last"] == {"mode": "owner", "broadcasts": 0, "exchanges": layers,
                               "bytes": owned * (world - 1) * part + (layers - owned) * part}
        assert "does not route" in res["unrouted"] and not res["broken_after_unrouted"]
        assert "ran outside its turn" in res["outside_turn"]
        assert "the step's load" in res["auto_without_load"] and "the step's load" in res["owner_without_load"]
        assert "an attention shape" in res["auto_without_shape"]
        assert "3 owner mode" in res["mismatch"] and "Nothing was moved" in res["mismatch"]
        assert "query tokens" in res["load_mismatch"] and "active-block" not in res["load_mismatch"]


def fp8_query_ranks(rank: int, world: int):
    """fp8 queries to each layer's owner, as a backend that quantizes its queries for an fp8 KV cache hands them
    to `forward_mqa` (vLLM's FlashMLA, FlashInfer MLA and CUTLASS MLA), and float32 outputs back. The owner's op
    stands in for the kernel: the dequantized queries times a fixed matrix. gloo has no fp8 type (a gather of
    fp8 tensors raises "Invalid scalar type"): the exchange moves their bytes."""
    from kvpp_fx.runtime.owner_exchange import HeadRule

    rt = owner_runtime(world, attention=attention_shape(world))
    rt.note_routing(rt.plan.target_layers, True)
    rule = HeadRule(heads=((0, 1),), token_dims=(0,), output_dim=1)
    like = torch.zeros(3, HEADS_PER_RANK, RANK_WIDTH)
    weights = torch.randn(TOY_WIDTH, RANK_WIDTH, generator=torch.Generator().manual_seed(7))

    def kernel(q):
        return (q.float() * FP8_SCALE) @ weights

    parts, own = {}, {}

    def attend(layer, view):
        query = (torch.cat(queries(rank, layer), dim=-1) / FP8_SCALE).to(torch.float8_e4m3fn)
        own[layer] = kernel(query)
        parts[layer] = rt.open_turn.owner_compute(rule, [query], lambda full: kernel(full[0]), output_like=like)

    owner_forward(rt, attend=attend)
    # plain values: a tensor would travel to the test as a file descriptor this process no longer serves
    return {"parts": {layer: (str(t.dtype), t.tolist()) for layer, t in parts.items()},
            "own": {layer: (str(t.dtype), t.tolist()) for layer, t in own.items()}, "last": rt.last_forward()}


FP8_SCALE = 0.05


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_queries_reach_the_owner_as_they_were_quantized(world):
    """Each rank receives exactly its own fp8 queries' output, computed on the layer's owner; one byte per query
    value crosses the link. The control: every rank's output differs from every other rank's own (a rank given
    another's heads, or the owner's, would show)."""
    results = launch(fp8_query_ranks, world)
    tokens, layers = 3, 4
    part = tokens * HEADS_PER_RANK * (TOY_WIDTH * 1 + RANK_WIDTH * 4)  # fp8 queries in, float32 output back
    owned = layers // world
    for rank, res in enumerate(results):
        assert res["last"]["exchanges"] == layers and res["last"]["mode"] == "owner", res["last"]
        assert res["last"]["bytes"] == owned * (world - 1) * part + (layers - owned) * part, res["last"]
        for layer in range(layers):
            assert res["parts"][layer][0] == "torch.float32"
            assert res["parts"][layer] == res["own"][layer], (rank, layer)
            for other in range(world):
                if other != rank:
                    assert res["parts"][layer] != results[other]["own"][layer], (rank, other, layer)


# --- failures ---------------------------------------------------------------------------------------------

def owner_stall_ranks(rank: int, world: int, timeout_s: float):
    """Rank 1 stops issuing collectives inside an owner-mode forward; rank 0 must get a timeout."""
    rt = owner_runtime(world, 60.0, timeout=timeout_s, attention=attention_shape(world))
    table, seq_lens, query_lens = metadata()

    def attend(layer, view):
        if rank == 1 and layer == 2:
            time.sleep(timeout_s + 10.0)
            os._exit(0)
        routed_attention(layer)(*queries(rank, layer), rt.typed_views(layer)["kv"], table, seq_lens, query_lens,
                                SCALE, layer)

    start = time.monotonic()
    try:
        owner_forward(rt, attend=attend)
    except E.TransferFailedError as exc:
        elapsed = time.monotonic() - start
        try:
            with rt.forward(True, mode="owner"):
                pass
        except E.RuntimeBrokenError as later:
            return {"error": type(exc).__name__, "elapsed": elapsed, "later": type(later).__name__}
        return {"error": type(exc).__name__, "elapsed": elapsed, "later": None}
    dist.barrier()
    return {"error": None}


def test_a_stalled_peer_in_owner_mode_times_out_and_breaks_the_runtime():
    timeout = 3.0
    results = launch(owner_stall_ranks, 2, timeout, timeout_s=90, may_die={1})
    res = results[0]
    assert res["error"] == "TransferTimeoutError", res
    assert res["elapsed"] < timeout + 5.0
    assert res["later"] == "RuntimeBrokenError"


def owner_failures_ranks(rank: int, world: int):
    """Non-owners skip cache writes; an owner that fails tells the others at once; a rank whose queries
    disagree with the load refuses before its gather (its peers time out)."""
    out = {}
    shape = attention_shape(world)
    table, seq_lens, query_lens = metadata()

    # 1. the cache writes of a layer run on its owner only
    rt = owner_runtime(world, attention=shape)
    before = {layer: rt.typed_views(layer)["kv"].clone() for layer in rt.plan.target_layers}
    write = torch.ops.kvpp_ref.write_kv.default

    def writes(layer, view):
        kv = torch.full((3, RANK_WIDTH), 1.0 + layer)
        RoutedOp(write, layer)(rt.typed_views(layer)["kv"], kv, torch.ones(3, ROPE), torch.tensor([0, 1, 2]), layer)

    owner_forward(rt, attend=writes)
    out["written"] = {layer: not torch.equal(before[layer], rt.typed_views(layer)["kv"])
                      for layer in rt.plan.target_layers}
    out["owned"] = list(rt.plan.owned_layers(rt.rank))

    # 2. the owner of layer 0 fails inside the op: the other ranks learn it from the scatter
    rt = owner_runtime(world, attention=shape)
    bad_table = torch.full_like(table, 99) if rank == 0 else table  # rank 0 owns layer 0

    def failing(layer, view):
        routed_attention(layer)(*queries(rank, layer), rt.typed_views(layer)["kv"], bad_table, seq_lens, query_lens,
                                SCALE, layer)

    start = time.monotonic()
    try:
        owner_forward(rt, attend=failing)
        out["owner_failure"] = None
    except Exception as exc:  # every rank: OwnerRoutingError (the owner's caused by the op's own error)
        out["owner_failure"] = (type(exc).__name__, time.monotonic() - start, rt.broken is not None,
                                type(exc.__cause__).__name__ if exc.__cause__ is not None else None)

    # 3. layers whose compiled graph is not routed: owner mode is refused up front, auto broadcasts
    rt = owner_runtime(world, attention=shape)
    rt.note_routing((0, 1), True)
    rt.note_routing((2, 3), False)
    try:
        with rt.forward(True, mode="owner", load=StepLoad(3, 30)):
            pass
        out["unrouted_owner"] = None
    except E.OwnerModeUnsupportedError as exc:
        out["unrouted_owner"] = (str(exc), rt.broken is not None)
    owner_forward(rt, attend=lambda layer, view: None, mode="auto", tokens=1)
    out["unrouted_auto"] = rt.last_forward()["choice"]

    # 4. rank 1's queries hold one token more than the agreed load
    rt = owner_runtime(world, 3.0, attention=shape)

    def mismatched(layer, view):
        q_latent, q_pe = queries(rank, layer, tokens=4 if rank == 1 else 3)
        routed_attention(layer)(q_latent, q_pe, rt.typed_views(layer)["kv"], table, seq_lens, query_lens, SCALE,
                                layer)

    try:
        owner_forward(rt, attend=mismatched)
        out["token_mismatch"] = None
    except (E.OwnerRoutingError, E.TransferFailedError) as exc:
        out["token_mismatch"] = (type(exc).__name__, str(exc))
    if rank == 1:
        time.sleep(5.0)  # stay connected, so the owner sees its own timeout rather than a closed peer
    return out


def test_owner_mode_failures_are_named_and_prompt():
    results = launch(owner_failures_ranks, 2)
    for rank, res in enumerate(results):
        # a non-owner's scratch slot is not written in owner mode; the owner's persistent cache is
        assert res["written"] == {layer: layer in res["owned"] for layer in range(4)}, res["written"]
        name, elapsed, broken, cause = res["owner_failure"]
        assert name == "OwnerRoutingError" and broken and cause == ("IndexError" if rank == 0 else None)
        assert elapsed < 10.0  # from the scatter's status, not the 20 s timeout
        message, broken = res["unrouted_owner"]
        assert "layers [2, 3] is not routed" in message and not broken
        assert res["unrouted_auto"] == {"mode": "broadcast",
                                        "why": "layers [2, 3] are not known to be routed for owner mode"}
    assert results[1]["token_mismatch"][0] == "OwnerRoutingError"
    assert "holds 4 query tokens, the forward's load 3" in results[1]["token_mismatch"][1]
    assert results[0]["token_mismatch"][0] == "TransferTimeoutError"


# --- a device's checks, read one step later; exchanges on their own group ------------------------------


class _Event:
    """An event that completes when the test says so (`LateChecks.complete`)."""

    def __init__(self, api) -> None:
        self.api = api

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return self.api.completed

    def synchronize(self) -> None:
        self.api.host_waits += 1


class LateChecks(DeviceAPI):
    """CPU collectives, with a device's checks: status values kept on the device and read later."""

    immediate_checks = False

    def __init__(self, device) -> None:
        super().__init__(device)
        self.completed = False
        self.host_waits = 0

    def read_later(self, value):
        return DeferredRead(value.clone(), _Event(self))


def late_check_ranks(rank: int, world: int, read_at: str):
    """The last layer's owner fails its op in an owner-mode forward. The owner raises there; a non-owner's
    status value says so only on the device: it is read when the next forward begins (its event has
    completed) or at `settle`, and not before."""
    api = LateChecks("cpu")
    rt = owner_runtime(world, attention=attention_shape(world), device_api=api)
    write_owned(rt, 1)
    table, seq_lens, query_lens = metadata()
    last = rt.plan.target_layers[-1]
    owner_of_1 = rt.plan.owners[last] == rank

    def attend(layer, view):
        q_latent, q_pe = queries(rank, layer)
        if layer == last and owner_of_1:
            bad = torch.zeros(1)  # the owner's op raises for this layer (a shape the kernel refuses)
            return routed_attention(layer)(q_latent, q_pe, bad, table, seq_lens, query_lens, SCALE, layer)
        return routed_attention(layer)(q_latent, q_pe, rt.typed_views(layer)["kv"], table, seq_lens, query_lens,
                                       SCALE, layer)

    out = {"owner": owner_of_1}
    try:
        owner_forward(rt, attend=attend)
        out["forward"] = "returned"
    except E.KVPPRuntimeError as exc:
        out["forward"] = type(exc).__name__
    out["pending"] = rt.pending_checks
    if not owner_of_1:
        try:
            if read_at == "settle":
                rt.settle()
            else:
                api.completed = True
                with rt.forward(False):
                    pass
            out["later"] = "nothing"
        except E.KVPPRuntimeError as exc:
            out["later"] = type(exc).__name__
        out["host_waits"] = api.host_waits
        try:
            with rt.forward(False):
                pass
        except E.KVPPRuntimeError as exc:
            out["after"] = type(exc).__name__
    return out


@pytest.mark.parametrize("read_at", ["next-forward", "settle"])
def test_an_owners_failure_on_a_device_is_read_one_step_later(read_at):
    results = launch(late_check_ranks, 2, read_at, timeout_s=120)
    owner = next(r for r in results if r["owner"])
    other = next(r for r in results if not r["owner"])
    assert owner["forward"] == "OwnerRoutingError", owner
    # the non-owner's forward returned (zeros for layer 1): its device flag waits, unread
    assert other["forward"] == "returned" and other["pending"] == 1, other
    assert other["later"] == "OwnerRoutingError" and other["after"] == "RuntimeBrokenError", other
    # the next forward read a completed event without waiting; settle waits where it must
    assert other["host_waits"] == (1 if read_at == "settle" else 0), other


class GroupRecording(DeviceAPI):
    """Logs each collective's kind, layer turn and communicator, in issue order."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.log = []

    def broadcast(self, tensor, src, group):
        self.log.append(("broadcast", id(group)))
        return super().broadcast(tensor, src, group)

    def gather(self, tensor, gather_list, dst, group):
        self.log.append(("gather", id(group)))
        return super().gather(tensor, gather_list, dst, group)

    def scatter(self, tensor, scatter_list, src, group):
        self.log.append(("scatter", id(group)))
        return super().scatter(tensor, scatter_list, src, group)


def queued_finish_times(log, slow_broadcast: float = 100.0, fast: float = 1.0):
    """When each collective finishes if every communicator runs its collectives one at a time in issue order
    (NCCL's rule): the broadcasts slow, the exchanges fast; issued one time unit apart."""
    free, finish = {}, []
    for issued, (kind, group) in enumerate(log):
        start = max(float(issued), free.get(group, 0.0))
        free[group] = start + (slow_broadcast if kind == "broadcast" else fast)
        finish.append(free[group])
    return finish


def hybrid_group_ranks(rank: int, world: int, own_group: bool):
    from kvpp_fx.cache.cost import RequestRows
    from kvpp_fx.runtime.owner_exchange import HeadRule

    api = GroupRecording("cpu")
    exchange = fresh_group(world, 20.0) if own_group else None
    rt = owner_runtime(world, attention=attention_shape(world), device_api=api, exchange_group=exchange)
    rt.note_routing(rt.plan.target_layers, True)
    write_owned(rt, 1)
    requests = (RequestRows(3, 42, (3, 7, 1), owner_capable=True), RequestRows(2, 20, (5, 2), owner_capable=False))

    rule = HeadRule(heads=((0, 1),), token_dims=(0,), output_dim=1)
    like = torch.zeros(3, HEADS_PER_RANK, RANK_WIDTH)

    def attend(layer, view):  # the owner request's rows, as vLLM's MLA hook sends them (`owner_rows`)
        query = torch.cat(queries(rank, layer), dim=-1)
        rt.open_turn.owner_compute(rule, [query], lambda full: torch.zeros(3, HEADS_PER_RANK * world, RANK_WIDTH),
                                     output_like=like)

    with rt.forward(True, mode="owner", requests=requests):
        assert rt.path.hybrid
        run_layers(rt, attend, routed=True)
    return api.log


@pytest.mark.parametrize("own_group", [True, False], ids=["exchange-group", "negative-control-one-group"])
def test_a_layers_exchange_does_not_queue_behind_the_next_layers_broadcast(own_group):
    """A hybrid forward issues layer L+1's prefetch broadcast before layer L's exchange. On its own group
    the exchange finishes at once; on the broadcasts' group it waits for that slow broadcast."""
    log = launch(hybrid_group_ranks, 2, own_group, timeout_s=120)[0]
    finish = queued_finish_times(log)
    exchanges = [i for i, (kind, _) in enumerate(log) if kind == "gather"]
    assert len(exchanges) == 4, log
    groups = ({group for kind, group in log if kind != "broadcast"},
              {group for kind, group in log if kind == "broadcast"})
    queued = [i for i in exchanges if finish[i] - i > 10]  # finished long after it was issued
    if own_group:
        assert not groups[0] & groups[1] and queued == [], (log, finish)
    else:
        assert groups[0] == groups[1] and queued, (log, finish)


def late_disagreement_ranks(rank: int, world: int, late: bool):
    """Ranks that disagree on a forward's load, in a forward that moves nothing. Checked late (a device's
    order) the disagreement is raised when the forward ends and breaks every rank; checked early (CPU) it
    is raised at the first op and the runtime stays usable."""
    api = LateChecks("cpu") if late else DeviceAPI("cpu")
    rt = owner_runtime(world, attention=attention_shape(world), device_api=api,
                       agreement_group=fresh_group(world, 20.0))
    out = {}
    try:
        with rt.forward(False, mode="broadcast", load=StepLoad(3 + rank, 10)):
            run_layers(rt)
            out["body"] = "finished"
    except E.BlockSetMismatchError as exc:
        out["error"] = str(exc)
    out.setdefault("body", "raised")
    out["broken"] = rt.broken is not None
    return out


@pytest.mark.parametrize("late", [True, False], ids=["checked-at-the-end", "checked-before-the-first-op"])
def test_a_disagreement_is_named_on_every_rank_wherever_it_is_checked(late):
    for out in launch(late_disagreement_ranks, 2, late, timeout_s=120):
        assert "query tokens" in out["error"], out
        assert out["broken"] is late, out
        assert out["body"] == ("finished" if late else "raised"), out
        assert ("runtime is broken" in out["error"]) is late, out
