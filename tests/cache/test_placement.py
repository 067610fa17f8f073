import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpp_fx.cache.placement import (
    ALIGNMENT,
    UNBOUNDED_BLOCKS,
    KVPPPlan,
    PoolTooSmallError,
    align_up,
    assign_owners,
    scratch_blocks_for,
)
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec

MiB = 1024 * 1024


def uniform_spec(num_layers, width=576, block_size=16, drafts=0, dtype="bfloat16"):
    comps = (ComponentSpec("kv", dtype, (width,)),)
    layers = [LayerCacheSpec(i, comps) for i in range(num_layers)]
    layers += [LayerCacheSpec(num_layers + j, comps, is_draft=True) for j in range(drafts)]
    return ModelCacheSpec("toy", block_size, tuple(layers))


layer_sets = st.lists(st.integers(0, 200), min_size=0, max_size=80, unique=True)


@given(layer_sets, st.integers(1, 16))
def test_every_layer_owned_exactly_once(layers, size):
    owners = assign_owners(layers, size)
    assert sorted(owners) == sorted(layers)
    assert all(0 <= r < size for r in owners.values())


@given(layer_sets, st.integers(1, 16))
def test_counts_balanced_lower_ranks_take_extra(layers, size):
    owners = assign_owners(layers, size)
    counts = [sum(1 for r in owners.values() if r == rank) for rank in range(size)]
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)


@given(layer_sets, st.integers(1, 16))
def test_ranges_contiguous_in_sorted_order(layers, size):
    owners = assign_owners(layers, size)
    ranks_in_order = [owners[i] for i in sorted(layers)]
    assert ranks_in_order == sorted(ranks_in_order)


@given(layer_sets, st.integers(1, 16), st.randoms())
def test_independent_of_input_order(layers, size, rnd):
    shuffled = list(layers)
    rnd.shuffle(shuffled)
    assert assign_owners(shuffled, size) == assign_owners(layers, size)


def test_design_examples():
    assert [assign_owners(range(8), 3)[i] for i in range(8)] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert assign_owners([0, 1], 4) == {0: 0, 1: 1}  # ranks 2 and 3 own nothing


def test_assign_owners_rejects_bad_input():
    with pytest.raises(ValueError, match="group_size"):
        assign_owners([0, 1], 0)
    with pytest.raises(ValueError, match="unique"):
        assign_owners([1, 1], 2)


def test_scratch_slots_alternate_counting_owned_layers():
    plan = KVPPPlan(uniform_spec(8), group_size=2)
    assert [plan.slot(i) for i in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    # rank 0 owns 0-3: no scratch slot there; layers 4.. keep the global alternation
    assert [plan.scratch_slot(i, 0) for i in range(8)] == [None] * 4 + [0, 1, 0, 1]
    assert [plan.scratch_slot(i, 1) for i in range(8)] == [0, 1, 0, 1] + [None] * 4


def test_scratch_slots_skip_draft_layers():
    plan = KVPPPlan(uniform_spec(3, drafts=1), group_size=2, depth=2)
    assert plan.target_layers == (0, 1, 2)
    assert plan.local_draft_layers == (3,)
    assert plan.owner(3) is None
    assert plan.scratch_slot(3, 0) is None and plan.scratch_slot(3, 1) is None
    with pytest.raises(KeyError):
        plan.slot(3)
    sharded = KVPPPlan(uniform_spec(3, drafts=1), group_size=2, shard_draft_layers=True)
    assert sharded.target_layers == (0, 1, 2, 3) and sharded.slot(3) == 1
    assert sharded.owner(3) == 1


def test_depth_three_and_depth_validation():
    plan = KVPPPlan(uniform_spec(7), group_size=2, depth=3)
    assert [plan.slot(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert sum(1 for b in plan.buffers(0) if b.kind == "scratch") == 3
    for bad in (0, 1, True, 2.0):
        with pytest.raises(ValueError, match="at least 2"):
            KVPPPlan(uniform_spec(4), group_size=2, depth=bad)


def test_layer_table_refuses_depth_one():
    from kvpp_fx.schedule import LayerSchedule

    with pytest.raises(ValueError, match="at least 2"):
        LayerSchedule((0, 1, 2), depth=1)
    assert LayerSchedule((0, 1, 2), depth=2).slot(2) == 0


def test_budget_at_its_exact_edges():
    # 4 layers of 576 bf16 x 16 tokens = 18432 B/block; rank 0 holds 2 owned + 2 scratch buffers (whose
    # blocks carry an 8-byte id each: 18440 B).
    plan = KVPPPlan(uniform_spec(4), group_size=2)
    assert plan.bundle_bytes_per_block(0) == 18432
    assert len(plan.buffers(0)) == 4
    # 113 blocks = 2,082,816 B -> one 2 MiB buffer each; 114 blocks spill to 4 MiB each.
    assert plan.bytes_for(113, 0) == 4 * 2 * MiB
    assert plan.bytes_for(114, 0) == 4 * 4 * MiB
    assert plan.num_blocks(8 * MiB, 0) == 113
    assert plan.num_blocks(8 * MiB - 1, 0) == 0
    assert plan.num_blocks(16 * MiB, 0) == 227   # 227 * 18432 = 4,184,064 <= 4 MiB
    assert plan.num_blocks(16 * MiB - 1, 0) == 113


@given(st.integers(1, 30), st.integers(1, 8), st.integers(1, 2_000_000_000))
@settings(max_examples=60)
def test_budget_is_tight_for_any_memory(layers, size, available):
    plan = KVPPPlan(uniform_spec(layers), group_size=size)
    for rank in range(size):
        n = plan.num_blocks(available, rank)
        assert plan.bytes_for(n, rank) <= available
        assert plan.bytes_for(n + 1, rank) > available
        cost = plan.bytes_for(n, rank)
        if n:
            assert plan.num_blocks(cost, rank) >= n > plan.num_blocks(cost - 1, rank)


def test_engine_blocks_are_the_worst_rank():
    plan = KVPPPlan(uniform_spec(61, width=576, block_size=128), group_size=8)
    avail = 64 * 1024 * MiB
    assert plan.num_blocks(avail) == min(plan.num_blocks(avail, r) for r in range(8))
    assert plan.num_blocks(avail) == plan.num_blocks(avail, 0)  # rank 0 owns ceil(61/8) = 8 layers


def test_capacity_ratio_matches_formula_within_alignment():
    L, N = 61, 8
    plan = KVPPPlan(uniform_spec(L, block_size=128), group_size=N)
    formula = L / (math.ceil(L / N) + 2)
    assert plan.formula_capacity_ratio() == pytest.approx(formula)
    ratio = plan.capacity_ratio(64 * 1024 * MiB)
    assert abs(ratio - formula) / formula < 1e-3
    assert ratio >= 6.10  # the seed's layout: no buffer beyond the persistent bundles and two slots


def test_scratch_blocks_come_from_the_longest_request_and_the_token_budget():
    assert scratch_blocks_for(131072, 8192, 128) == 1024 + 64
    assert scratch_blocks_for(100, 30, 16) == 7 + 2  # partial blocks round up
    for bad in ((0, 1, 1), (1, 0, 1), (1, 1, 0), (1.5, 1, 1), (True, 1, 1)):
        with pytest.raises(ValueError, match="positive int"):
            scratch_blocks_for(*bad)
    spec = uniform_spec(61, width=576, block_size=128)
    plan = KVPPPlan.for_requests(spec, 8, max_model_len=131072, token_budget=8192)
    assert (plan.scratch_blocks, plan.request_blocks, plan.compact) == (1088, 1024, True)
    assert KVPPPlan.for_requests(spec, 8, max_model_len=131072, token_budget=8192,
                                 scratch_blocks=50).scratch_blocks == 50
    assert not KVPPPlan.for_requests(spec, 8).compact
    with pytest.raises(ValueError, match="token budget"):
        KVPPPlan.for_requests(spec, 8, max_model_len=4096)


def test_compact_slots_are_a_fixed_cost():
    """Compact slots hold S blocks whatever the pool, each block with its 8-byte id; the persistent
    bundles alone grow with the pool. The ratio is L / ceil(L/N) * (1 - depth * S * b / M)."""
    L, N, S = 61, 8, 1088
    bpb = 576 * 2 * 128
    plan = KVPPPlan(uniform_spec(L, width=576, block_size=128), group_size=N, scratch_blocks=S)
    slots = [b for b in plan.buffers(0) if b.kind == "scratch"]
    assert len(slots) == 2 and all(b.blocks(10) == b.blocks(10_000) == S for b in slots)
    assert plan.fixed_bytes(0) == 2 * -(-S * (bpb + 8) // (2 * MiB)) * 2 * MiB
    assert plan.scratch_bytes_per_block(0) == 0 and plan.slot_blocks(5000) == S
    # 1024 blocks of a layer are exactly 72 MiB: no padding in the persistent bundles
    assert plan.bytes_for(2048, 0) - plan.bytes_for(1024, 0) == plan.bytes_for(1024, 0) - plan.fixed_bytes(0) \
        == 8 * 1024 * bpb
    available = 64 * 1024 * MiB
    formula = L / math.ceil(L / N) * (1 - 2 * S * bpb / available)
    assert plan.formula_capacity_ratio(available) == pytest.approx(formula)
    assert abs(plan.capacity_ratio(available) - formula) / formula < 1e-3
    assert plan.capacity_ratio(available) > 7.4 > plan.whole_layer().capacity_ratio(available)
    with pytest.raises(ValueError, match="memory per rank"):
        plan.formula_capacity_ratio()


@given(st.integers(1, 30), st.integers(2, 8), st.integers(1, 5000), st.integers(1, 2_000_000_000))
@settings(max_examples=60)
def test_budget_with_compact_slots_is_tight(layers, size, slot, available):
    plan = KVPPPlan(uniform_spec(layers), group_size=size, scratch_blocks=slot)
    for rank in range(size):
        n = plan.num_blocks(available, rank)
        if not plan.owned_layers(rank):  # compact slots only: nothing grows with the pool
            assert n == (UNBOUNDED_BLOCKS if plan.fixed_bytes(rank) <= available else 0)
            continue
        assert available < plan.bytes_for(n + 1, rank)
        assert plan.bytes_for(n, rank) <= available or n == 0  # the slots alone may not fit


@pytest.mark.parametrize("bad", [0, -3, 1.5, "8", True])
def test_scratch_blocks_are_validated(bad):
    with pytest.raises(ValueError, match="scratch_blocks"):
        KVPPPlan(uniform_spec(4), group_size=2, scratch_blocks=bad)


def test_a_pool_must_hold_the_longest_request_and_one_more():
    plan = KVPPPlan.for_requests(uniform_spec(4), 2, max_model_len=160, token_budget=32)  # 10 + 2 blocks
    plan.check_pool(12)
    with pytest.raises(PoolTooSmallError, match="no other request next to one of max_model_len [(]10 blocks[)]"):
        plan.check_pool(10)
    with pytest.raises(PoolTooSmallError, match="wider than the pool of 11 blocks"):
        plan.check_pool(11)


def test_more_ranks_than_layers():
    plan = KVPPPlan(uniform_spec(2), group_size=4)
    assert [plan.owned_layers(r) for r in range(4)] == [(0,), (1,), (), ()]
    assert [b.kind for b in plan.buffers(3)] == ["scratch", "scratch"]


def test_group_of_one_owns_everything_and_needs_no_scratch():
    plan = KVPPPlan(uniform_spec(4, drafts=1), group_size=1)
    assert not plan.enabled
    assert [b.kind for b in plan.buffers(0)] == ["persistent"] * 4 + ["draft"]
    assert plan.num_blocks(64 * MiB) == plan.replicated_num_blocks(64 * MiB)
    assert plan.broadcast_bytes_per_forward(10) == 0


def test_component_major_layout():
    comps = (ComponentSpec("kv", "bfloat16", (576,)), ComponentSpec("indexer", "float8_e4m3fn", (128,)),
             ComponentSpec("indexer_scale", "float32", (1,)))
    spec = ModelCacheSpec("sfa", 64, tuple(LayerCacheSpec(i, comps) for i in range(2)))
    plan = KVPPPlan(spec, group_size=2)
    layout = plan.layout(0, num_blocks=10)
    assert [(c.name, c.offset, c.size) for c in layout] == [
        ("kv", 0, 10 * 64 * 1152),
        ("indexer", 10 * 64 * 1152, 10 * 64 * 128),
        ("indexer_scale", 10 * 64 * (1152 + 128), 10 * 64 * 4),
    ]
    assert layout[-1].offset + layout[-1].size == 10 * plan.bundle_bytes_per_block(0)


def test_pipeline_stage_subset():
    plan = KVPPPlan(uniform_spec(8), group_size=2, layers=(4, 5, 6, 7))
    assert plan.owned_layers(0) == (4, 5) and plan.owned_layers(1) == (6, 7)
    assert plan.slot(4) == 0 and plan.slot(5) == 1


def test_rank_outside_group_is_named():
    plan = KVPPPlan(uniform_spec(4), group_size=2)
    with pytest.raises(ValueError, match="outside the group"):
        plan.owned_layers(2)
    assert align_up(1) == ALIGNMENT and align_up(0) == 0


def test_the_schedule_every_forward_follows():
    from kvpp_fx.schedule import LayerSchedule, ScheduleStep

    schedule = LayerSchedule((4, 7, 9), draft_layers=(10,), depth=2)
    steps = [(s.kind, s.layer, s.slot) for s in schedule.steps()]
    assert steps == [("prefetch", 4, 0), ("wait", 4, 0), ("prefetch", 7, 1), ("wait", 7, 1), ("prefetch", 9, 0),
                     ("wait", 9, 0)]
    assert schedule.at_layer(9) == (ScheduleStep("wait", 9, 0),)  # nothing after the last layer
    assert LayerSchedule(()).steps() == () and LayerSchedule(()).first() is None
    # A layer's entry: the first layer's prefetch before the first layer's own steps, nothing more elsewhere.
    assert schedule.entry(4) == (ScheduleStep("prefetch", 4, 0), *schedule.at_layer(4))
    assert schedule.entry(7) == schedule.at_layer(7)
    assert [schedule.next(layer) for layer in (4, 7, 9)] == [7, 9, None]
    assert [schedule.slot(layer) for layer in (4, 7, 9)] == [0, 1, 0]
    for draft in (10, 5):  # drafts (and unknown layers) have no position, slot or ops
        assert not schedule.is_target(draft)
        with pytest.raises(KeyError, match=f"layer {draft} is not a target layer"):
            schedule.slot(draft)

    class Recorder:
        def __init__(self):
            self.calls = []

        def prefetch(self, layer, slot):
            self.calls.append(("prefetch", layer, slot))

        def wait(self, layer, slot):
            self.calls.append(("wait", layer, slot))

    whole, per_layer = Recorder(), Recorder()
    schedule.run(whole)
    for layer in (4, 7, 9):
        schedule.run(per_layer, layer)
    assert whole.calls == per_layer.calls == steps


def test_depth_three_over_non_contiguous_layers_literal_table():
    """The slot and owner rule, written out by hand for depth 3, 3 ranks and layer indices with gaps, given
    out of order, with two local drafts: sorted targets 3 4 9 11 17 20 31; 7 = 3 x 2 + 1, so rank 0 owns
    three (3 4 9), ranks 1 and 2 two each; the k-th target reads slot k % 3 wherever it is not owned."""
    comps = (ComponentSpec("kv", "bfloat16", (576,)),)
    layers = [LayerCacheSpec(i, comps) for i in (11, 3, 20, 4, 9, 31, 17)]
    layers += [LayerCacheSpec(i, comps, is_draft=True) for i in (32, 33)]
    plan = KVPPPlan(ModelCacheSpec("gaps", 16, tuple(layers)), group_size=3, depth=3)
    table = {  # layer: (slot, owner)
        3: (0, 0), 4: (1, 0), 9: (2, 0), 11: (0, 1), 17: (1, 1), 20: (2, 2), 31: (0, 2)}
    assert plan.target_layers == (3, 4, 9, 11, 17, 20, 31)
    assert {layer: (plan.slot(layer), plan.owner(layer)) for layer in plan.target_layers} == table
    for rank in range(3):
        assert {layer: plan.scratch_slot(layer, rank) for layer in table} == {
            layer: None if owner == rank else slot for layer, (slot, owner) in table.items()}
        assert plan.scratch_slot(32, rank) is None and plan.owner(32) is None  # drafts stay local
