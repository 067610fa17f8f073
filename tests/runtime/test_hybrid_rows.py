"""Hybrid forwards on real gloo ranks: one request's rows go to each layer's owner, another's read the
blocks broadcast for it alone, in the same forward (``runtime.forward(requests=...)``).

Each layer's turn runs what vLLM's MLA hook runs: the owner rows through ``runtime.owner_compute`` (the
reference attention over all heads on the owner), the broadcast rows locally over the layer's view.
"""

from __future__ import annotations

import time

import pytest
import torch

import kvpp_fx.reference.ops  # noqa: F401  (defines the kvpp_ref ops)
from kvpp_fx.cache.cost import BROADCAST, OWNER, RequestRows
from kvpp_fx.runtime import errors as E
from tests.runtime.test_owner_runtime import (
    ATTENTION,
    SCALE,
    attention_shape,
    owner_runtime,
    queries,
    routed_attention,
)
from tests.support.faults import SkippedGather, SwappedHeads
from tests.support.launch import launch
from tests.support.toy_runtime import pattern, run_layers, write_owned

pytestmark = pytest.mark.multirank

# Blocks of 4 tokens. Request 0 decodes 1 token after 8 computed ones (blocks 3, 7): its rows go to the
# owner. Request 1 prefills 2 tokens after 5 computed ones (blocks 5, 2): its rows read those by broadcast.
OWNER_TABLE, OWNER_SEQ, OWNER_Q = torch.tensor([[3, 7, 1, 0]], dtype=torch.int32), torch.tensor([9]), torch.tensor([1])
LOCAL_TABLE, LOCAL_SEQ, LOCAL_Q = torch.tensor([[5, 2, 0, 0]], dtype=torch.int32), torch.tensor([7]), torch.tensor([2])
REQUESTS = (RequestRows(1, 9, (3, 7), owner_capable=True), RequestRows(2, 14, (5, 2), owner_capable=False))


def hybrid_forward(rt, rank, *, requests=REQUESTS, mode="owner", skip_exchange_of=None, failing_layer=None):
    """One forward: per layer, the owner rows on the owner, the broadcast rows over the layer's view."""
    out = {}

    def attend(layer, view):
        q_latent, q_pe = queries(rank, layer, tokens=3)
        cache = rt.typed_views(layer)["kv"]  # persistent on the owner, the layer's scratch slot elsewhere
        owner_rows = None
        if layer != skip_exchange_of and rt.path.owner_tokens:
            table = torch.full_like(OWNER_TABLE, 99) if layer == failing_layer else OWNER_TABLE

            def on_owner(full):
                return ATTENTION(full[0], full[1], rt.typed_views(layer)["kv"], table, OWNER_SEQ, OWNER_Q, SCALE,
                                 layer)

            owner_rows = rt.open_turn.owner_compute(routed_attention(layer), [q_latent[:1], q_pe[:1]], on_owner)
        # the step's table, one row per request, as this rank reads the layer (remapped where packed)
        (table,) = rt.open_turn.tables([torch.cat([OWNER_TABLE, LOCAL_TABLE])], ["block_table"])
        local_rows = ATTENTION(q_latent[1:], q_pe[1:], cache, table[1:], LOCAL_SEQ, LOCAL_Q, SCALE, layer)
        out[layer] = (owner_rows, local_rows)

    with rt.forward(True, mode=mode, requests=requests):
        run_layers(rt, attend, routed=True)
    return out


def expected(rank, layer):
    q_latent, q_pe = queries(rank, layer, tokens=3)
    cache = pattern(1, layer)
    return (ATTENTION(q_latent[:1], q_pe[:1], cache, OWNER_TABLE, OWNER_SEQ, OWNER_Q, SCALE, layer),
            ATTENTION(q_latent[1:], q_pe[1:], cache, LOCAL_TABLE, LOCAL_SEQ, LOCAL_Q, SCALE, layer))


def hybrid_ranks(rank: int, world: int):
    out = {}
    shape = attention_shape(world)

    def exact(results):
        return {layer: [torch.equal(got, want) for got, want in zip(results[layer], expected(rank, layer))]
                for layer in results}

    # 1. both paths in one forward, each row exactly the attention over the owner's bytes
    rt = owner_runtime(world, attention=shape)
    write_owned(rt, 1)
    out["exact"] = exact(hybrid_forward(rt, rank))
    last = rt.last_forward()
    out["last"] = {k: last[k] for k in ("mode", "broadcasts", "exchanges", "rows")}
    out["last"]["modes"] = last["choice"]["modes"]
    # only request 1's blocks move: 2 blocks of 4 tokens x 8 float32 values, plus their ids, per layer
    out["broadcast_bytes"] = last["broadcast_bytes"]

    # 2. broadcast for every request: the same rows, now all over the slot
    rt = owner_runtime(world, attention=shape)
    write_owned(rt, 1)
    with rt.forward(True, mode="broadcast", requests=REQUESTS):
        out["paths_inside"] = rt.path.request_paths
        run_layers(rt, routed=True)
    out["broadcast_mode"] = rt.last_forward()["mode"]

    # 3. negative controls through the seam: the owner rows change, the broadcast rows do not
    for name, fault in (("swapped", SwappedHeads), ("skipped", SkippedGather)):
        rt = owner_runtime(world, attention=shape, device_api=fault(torch.device("cpu")))
        write_owned(rt, 1)
        out[name] = exact(hybrid_forward(rt, rank))
        out["owned"] = list(rt.plan.owned_layers(rank))

    # 4. a layer whose op skips its exchange: every rank names it at the next layer's wait
    rt = owner_runtime(world, attention=shape)
    write_owned(rt, 1)
    try:
        hybrid_forward(rt, rank, skip_exchange_of=0)
        out["skipped_exchange"] = None
    except E.OwnerRoutingError as exc:
        out["skipped_exchange"] = str(exc)

    # 5. the owner of layer 1 fails inside the op in the middle of the forward: every rank gets
    # OwnerRoutingError at once (the owner's caused by the op's own error, the others' from the scatter's
    # status)
    rt = owner_runtime(world, attention=shape)
    write_owned(rt, 1)
    out["owner_of_1"] = rt.plan.owners[1]
    start = time.monotonic()
    try:
        hybrid_forward(rt, rank, failing_layer=1)
        out["owner_failure"] = None
    except Exception as exc:  # noqa: BLE001 - the test compares the kinds
        out["owner_failure"] = (type(exc).__name__, time.monotonic() - start, rt.broken is not None,
                                type(exc.__cause__).__name__ if exc.__cause__ is not None else None)

    # 6. ranks that disagree on a request's path refuse the forward together, before anything moves
    rt = owner_runtime(world, attention=shape)
    mine = REQUESTS if rank == 0 else (RequestRows(1, 9, (3, 7), owner_capable=False), REQUESTS[1])
    try:
        with rt.forward(True, mode="owner", requests=mine):
            pass
        out["disagree"] = None
    except E.BlockSetMismatchError as exc:
        out["disagree"] = (str(exc), rt.broken is not None)

    # 7. a routed op (owner rows only, or none) refuses a hybrid forward by name
    rt = owner_runtime(world, attention=shape)
    try:
        hybrid_forward_with_routed_op(rt, rank)
        out["routed_op"] = None
    except E.OwnerRoutingError as exc:
        out["routed_op"] = str(exc)
    return out


def hybrid_forward_with_routed_op(rt, rank):
    def attend(layer, view):
        q_latent, q_pe = queries(rank, layer, tokens=3)
        routed_attention(layer)(q_latent, q_pe, rt.typed_views(layer)["kv"], OWNER_TABLE, OWNER_SEQ, OWNER_Q, SCALE,
                                layer)

    with rt.forward(True, mode="owner", requests=REQUESTS):
        run_layers(rt, attend, routed=True)


@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_forwards(world):
    results = launch(hybrid_ranks, world)
    for rank, res in enumerate(results):
        assert all(all(pair) for pair in res["exact"].values()) and len(res["exact"]) == 4, res["exact"]
        assert res["last"] == {"mode": "hybrid", "broadcasts": 4, "exchanges": 4, "modes": [OWNER, BROADCAST],
                               "rows": {"broadcast": 2, "owner": 1}}
        assert res["broadcast_bytes"] == 4 * 2 * (4 * 8 * 4 + 8)
        assert res["paths_inside"] == (BROADCAST, BROADCAST) and res["broadcast_mode"] == "broadcast"
        # the owner rows are wrong where the fault acts: every layer when each rank gets the next rank's heads
        # (the owner too), the layers another rank owns when owners compute with their own queries only
        for name, wrong in (("swapped", set(res["swapped"])), ("skipped", set(res["skipped"]) - set(res["owned"]))):
            assert all(local for _, local in res[name].values()), name
            assert {layer for layer, (owner, _) in res[name].items() if not owner} == wrong, (name, rank, res[name])
        assert "layer 0's attention ran in a forward with 1 owner rows without exchanging them" \
            in res["skipped_exchange"]
        name, elapsed, broken, cause = res["owner_failure"]
        assert name == "OwnerRoutingError" and broken, res["owner_failure"]
        assert cause == ("IndexError" if rank == res["owner_of_1"] else None), res["owner_failure"]
        assert elapsed < 10.0  # from the scatter's status, not the 20 s timeout
        message, broken = res["disagree"]
        assert "requests' paths (owner or broadcast)" in message and not broken
        assert "ran in a hybrid forward" in res["routed_op"]


def test_choose_rows_sends_long_decodes_to_the_owner_and_prefills_to_the_broadcast():
    from kvpp_fx.cache.cost import AttentionShape, BroadcastCost, LinkModel, choose_rows

    # DeepSeek-V3 at TP 8: 128 heads, 576 values in and 512 out per head, bf16; 128-token blocks of 1152 B
    # per token (plus the id)
    shape, link = AttentionShape(128, 576, 512, 2), LinkModel(bytes_per_s=150e9, latency_s=20e-6,
                                                               attention_flops_per_s=200e12)
    block = 128 * 1152 + 8
    long_decode = RequestRows(1, 100_000, tuple(range(800)))
    short_decode = RequestRows(1, 40, (900,))
    prefill = RequestRows(2048, 2048 * 60_000, tuple(range(1000, 1469)), owner_capable=False)
    choice = choose_rows(shape, (long_decode, short_decode, prefill), "auto", block, 8, link)
    assert choice.modes == (OWNER, BROADCAST, BROADCAST) and choice.hybrid
    assert choice.broadcast_blocks == (900, *range(1000, 1469)) and choice.owner_tokens == 1
    assert choice.owner_bytes == 7 * 1 * 16 * (576 + 512) * 2
    # a prefill-capable request is still broadcast when its queries cost more than its history
    big = RequestRows(2048, 2048 * 60_000, tuple(range(469)))
    assert choose_rows(shape, (big,), "auto", block, 8, link).modes == (BROADCAST,)
    # the collectives' fixed cost: on a slow-latency link, a decode over 3 blocks saves less than two of them
    three = RequestRows(1, 400, (900, 901, 902))
    alone = choose_rows(shape, (three,), "auto", block, 8, LinkModel(2.7e9, 400e-6, 1e15))
    assert alone.modes == (BROADCAST,) and "fixed cost" in alone.why
    assert choose_rows(shape, (short_decode, prefill), "owner", block, 8, link).modes == (OWNER, BROADCAST)
    assert choose_rows(shape, (long_decode,), "broadcast", block, 8, link).modes == (BROADCAST,)
    with pytest.raises(ValueError, match="mode must be one of"):
        choose_rows(shape, (long_decode,), "sideways", block, 8, link)
    # past the active-block limit a broadcast moves the whole layer, and the choice weighs that
    limited = BroadcastCost(block, 1, 40_000 * block)
    assert (limited.bytes(0), limited.bytes(1), limited.bytes(2)) == (0, block, 40_000 * block)
    over = RequestRows(1, 30, (1, 2))
    assert choose_rows(shape, (over,), "auto", block, 8, link).modes == (BROADCAST,)
    assert choose_rows(shape, (over,), "auto", limited, 8, link).modes == (OWNER,)


def test_requests_exclude_blocks_and_load():
    from kvpp_fx.cache.cost import StepLoad
    from tests.support.toy_runtime import toy_runtime

    rt = toy_runtime(None, 2)
    with pytest.raises(ValueError, match="derives the blocks and the load"):
        with rt.forward(True, blocks=[1], requests=REQUESTS):
            pass
    with pytest.raises(ValueError, match="derives the blocks and the load"):
        with rt.forward(True, load=StepLoad(1, 1), requests=REQUESTS):
            pass
    with rt.forward(True, mode="owner", requests=REQUESTS):  # a group of one: nothing moves
        assert rt.path.request_paths == (BROADCAST, BROADCAST) and rt.path.owner_tokens == 0
        run_layers(rt)
