import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpp_fx.cache.placement import ALIGNMENT, KVPPPlan, align_up, assign_owners
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
    from kvpp_fx.passes.layer_table import LayerTable

    with pytest.raises(ValueError, match="at least 2"):
        LayerTable((0, 1, 2), depth=1)
    assert LayerTable((0, 1, 2), depth=2).slot(2) == 0


def test_budget_at_its_exact_edges():
    # 4 layers of 576 bf16 x 16 tokens = 18432 B/block; rank 0 holds 2 owned + 2 scratch buffers.
    plan = KVPPPlan(uniform_spec(4), group_size=2, staging_fraction=0.0)
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
    plan = KVPPPlan(uniform_spec(L, block_size=128), group_size=N, staging_fraction=0.0)
    formula = L / (math.ceil(L / N) + 2)
    assert plan.formula_capacity_ratio() == pytest.approx(formula)
    ratio = plan.capacity_ratio(64 * 1024 * MiB)
    assert abs(ratio - formula) / formula < 1e-3


def test_staging_is_counted_in_the_budget():
    L, N, f = 61, 8, 0.25
    plan = KVPPPlan(uniform_spec(L, block_size=128), group_size=N, staging_fraction=f)
    bpb = 576 * 2 * 128
    # staging: f of a block of the largest bundle, plus the 8-byte id of each staged block
    formula = L / (math.ceil(L / N) + 2 + f * (bpb + 8) / bpb)
    assert plan.formula_capacity_ratio() == pytest.approx(formula)
    available = 64 * 1024 * MiB
    assert abs(plan.capacity_ratio(available) - formula) / formula < 1e-3
    assert plan.capacity_ratio(available) < plan.without_staging().capacity_ratio(available)
    n = plan.num_blocks(available, 0)
    assert plan.staging_blocks(n) == math.ceil(f * n)
    staging = [b for b in plan.buffers(0) if b.kind == "staging"]
    assert len(staging) == 1 and staging[0].nbytes(n) == -(-math.ceil(f * n) * (bpb + 8) // (2 * MiB)) * 2 * MiB
    assert plan.bytes_for(n, 0) <= available < plan.bytes_for(n + 1, 0)


@given(st.integers(1, 30), st.integers(2, 8), st.floats(0.0, 1.0), st.integers(1, 2_000_000_000))
@settings(max_examples=60)
def test_budget_with_staging_is_tight(layers, size, fraction, available):
    plan = KVPPPlan(uniform_spec(layers), group_size=size, staging_fraction=fraction)
    for rank in range(size):
        n = plan.num_blocks(available, rank)
        assert plan.bytes_for(n, rank) <= available < plan.bytes_for(n + 1, rank)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.2", True, float("nan")])
def test_staging_fraction_is_validated(bad):
    with pytest.raises(ValueError, match="staging_fraction"):
        KVPPPlan(uniform_spec(4), group_size=2, staging_fraction=bad)


def test_more_ranks_than_layers():
    plan = KVPPPlan(uniform_spec(2), group_size=4)
    assert [plan.owned_layers(r) for r in range(4)] == [(0,), (1,), (), ()]
    assert [b.kind for b in plan.buffers(3)] == ["scratch", "scratch", "staging"]


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
    from kvpp_fx.cache.placement import BroadcastSchedule, ScheduleStep

    schedule = BroadcastSchedule((4, 7, 9), depth=2)
    steps = [(s.kind, s.layer, s.slot) for s in schedule.steps()]
    assert steps == [("prefetch", 4, 0), ("wait", 4, 0), ("prefetch", 7, 1), ("wait", 7, 1), ("prefetch", 9, 0),
                     ("wait", 9, 0)]
    assert schedule.at_layer(9) == (ScheduleStep("wait", 9, 0),)  # nothing after the last layer
    assert BroadcastSchedule((), 2).steps() == () and BroadcastSchedule((), 2).first() is None

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
