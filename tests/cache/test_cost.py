"""The broadcast/owner cost model as pure functions, with expected values worked out by hand."""

import dataclasses
import math

import pytest

from kvpp_fx.cache.cost import (BROADCAST, OWNER, AttentionShape, LinkModel, StepLoad, broadcast_seconds,
                                choose_mode, owner_seconds)
from kvpp_fx.cache.spec import PRESETS, AttentionGeometryError, attention_shape_from_hf_config
from kvpp_fx.cli.step_cost import step_load

# DeepSeek-V3 absorbed MLA: 128 heads, q = 512 + 64 values, out = 512 values, bf16.
V3 = AttentionShape(num_heads=128, q_width=576, out_width=512, itemsize=2)
V3_BYTES_PER_BLOCK = 576 * 2 * 128          # one layer's bf16 latent cache, 128-token blocks
# An H200-class device: 400 GB/s, 20 us per collective, 400 TFLOP/s of attention.
DEVICE = LinkModel(bytes_per_s=400e9, latency_s=20e-6, attention_flops_per_s=400e12)


def test_owner_exchange_peak_by_hand():
    # DeepSeek-V3 at TP 8, 1024 decode rows, bf16: the owner's packed queries (16 heads), every rank's
    # gathered and concatenated (2 x 128 heads), the output over 128 heads and its parts, the part back,
    # each part with a status value.
    rows, heads = 1024, 16
    queries = rows * heads * 576 * (1 + 2 * 8)
    outputs = rows * heads * 512 * (1 + 2 * 8) + 8 + 1
    assert V3.owner_exchange_peak_bytes(rows, 8) == (queries + outputs) * 2 == 606_076_946
    assert V3.owner_exchange_peak_bytes(0, 8) == 18  # the status values alone
    with pytest.raises(ValueError, match="query_tokens"):
        V3.owner_exchange_peak_bytes(-1, 8)


def test_owner_bytes_per_layer_by_hand():
    # 8 ranks, 16 heads each: 7 ranks send 16 x 576 values per token and get 16 x 512 back, 2 B each.
    assert V3.owner_bytes_per_layer(query_tokens=1, group_size=8) == 7 * 16 * (576 + 512) * 2 == 243_712
    assert V3.owner_bytes_per_layer(query_tokens=10, group_size=8) == 2_437_120
    small = AttentionShape(num_heads=4, q_width=3, out_width=2, itemsize=4)
    assert small.owner_bytes_per_layer(query_tokens=5, group_size=2) == 200   # 1 rank x 5 x 2 heads x 5 x 4 B
    assert small.owner_bytes_per_layer(query_tokens=0, group_size=2) == 0
    assert small.owner_bytes_per_layer(query_tokens=5, group_size=1) == 0     # no other rank, nothing moves


def test_heads_split_evenly_or_raise():
    assert V3.split(8) == 16 and V3.split(1) == 128
    lite = AttentionShape(num_heads=16, q_width=576, out_width=512, itemsize=2)
    for call in (lambda: lite.split(3), lambda: lite.owner_bytes_per_layer(1, 3),
                 lambda: owner_seconds(lite, StepLoad(1, 100), 3, DEVICE),
                 lambda: choose_mode(lite, StepLoad(1, 100), 1000, 3, DEVICE)):
        with pytest.raises(ValueError, match="16 heads do not split over a group of 3"):
            call()


def test_attention_flops_by_hand():
    assert V3.attention_flops(attention_pairs=1000, heads=112) == 2 * 1000 * 112 * 1088 == 243_712_000


def test_broadcast_seconds_by_hand():
    link = LinkModel(bytes_per_s=1e9, latency_s=1e-4, attention_flops_per_s=1e12)
    assert broadcast_seconds(0, link) == 0.0                      # nothing to send: no collective either
    assert broadcast_seconds(2_000_000, link) == pytest.approx(1e-4 + 2e-3)


def test_owner_seconds_by_hand():
    shape = AttentionShape(num_heads=4, q_width=3, out_width=2, itemsize=4)
    link = LinkModel(bytes_per_s=1000.0, latency_s=0.5, attention_flops_per_s=100.0)
    load = StepLoad(query_tokens=5, attention_pairs=50)
    # 2 collectives x 0.5 s + 200 B / 1000 B/s + (2 x 50 pairs x 2 extra heads x 5 values) / 100 FLOP/s
    assert owner_seconds(shape, load, 2, link) == pytest.approx(1.0 + 0.2 + 10.0)


def test_choice_carries_both_sides():
    load = StepLoad(query_tokens=1, attention_pairs=1_000_000)
    broadcast_bytes = math.ceil(1_000_000 / 128) * V3_BYTES_PER_BLOCK
    choice = choose_mode(V3, load, broadcast_bytes, 8, DEVICE)
    assert choice.broadcast_bytes == 7813 * 147_456
    assert choice.owner_bytes == 243_712
    assert choice.broadcast_s == pytest.approx(20e-6 + 7813 * 147_456 / 400e9)
    compute = 2 * 1_000_000 * 112 * 1088 / 400e12
    assert choice.owner_s == pytest.approx(2 * 20e-6 + 243_712 / 400e9 + compute)


def test_prefill_chooses_broadcast_and_long_decode_chooses_owner():
    # A 4096-token prefill chunk over 1000 tokens of history: few blocks to broadcast, many queries.
    prefill = StepLoad(query_tokens=4096, attention_pairs=4096 * 1000 + 4096 * 4097 // 2)
    prefill_blocks = math.ceil(1000 / 128)
    assert choose_mode(V3, prefill, prefill_blocks * V3_BYTES_PER_BLOCK, 8, DEVICE).mode == BROADCAST
    # One decode token over 1M tokens of history: 1.15 GB per layer against 238 KiB.
    decode = StepLoad(query_tokens=1, attention_pairs=1_000_000)
    decode_blocks = math.ceil(1_000_000 / 128)
    assert choose_mode(V3, decode, decode_blocks * V3_BYTES_PER_BLOCK, 8, DEVICE).mode == OWNER
    # The same decode step at short context broadcasts: 8 blocks are cheaper than two collectives.
    short = StepLoad(query_tokens=1, attention_pairs=1000)
    assert choose_mode(V3, short, prefill_blocks * V3_BYTES_PER_BLOCK, 8, DEVICE).mode == BROADCAST
    # On the runtime's CPU defaults (20 GFLOP/s) the owner's extra attention over 1M pairs outweighs the link.
    assert choose_mode(V3, decode, decode_blocks * V3_BYTES_PER_BLOCK, 8, LinkModel()).mode == BROADCAST


def test_a_tie_broadcasts():
    # No latency and no attention pairs: owner mode costs its bytes over the link, like a broadcast.
    link = LinkModel(bytes_per_s=1e9, latency_s=0.0, attention_flops_per_s=1e12)
    load = StepLoad(query_tokens=3, attention_pairs=0)
    owner_bytes = V3.owner_bytes_per_layer(3, 8)
    tie = choose_mode(V3, load, owner_bytes, 8, link)
    assert tie.broadcast_s == tie.owner_s and tie.mode == BROADCAST
    assert choose_mode(V3, load, owner_bytes + 1, 8, link).mode == OWNER      # one byte more flips it
    assert choose_mode(V3, load, owner_bytes - 1, 8, link).mode == BROADCAST


def test_nothing_to_broadcast_never_chooses_owner():
    choice = choose_mode(V3, StepLoad(query_tokens=8192, attention_pairs=0), 0, 8, DEVICE)
    assert choice.mode == BROADCAST and choice.broadcast_s == 0.0 and choice.owner_s > 0


@pytest.mark.parametrize("field", ["num_heads", "q_width", "out_width", "itemsize"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8", None])
def test_attention_shape_refuses_non_positive_ints(field, value):
    fields = {"num_heads": 128, "q_width": 576, "out_width": 512, "itemsize": 2, field: value}
    with pytest.raises(ValueError, match=f"AttentionShape.{field} must be a positive int"):
        AttentionShape(**fields)


@pytest.mark.parametrize("field,value,needle", [
    ("bytes_per_s", 0.0, "bytes_per_s must be positive"), ("bytes_per_s", -1.0, "bytes_per_s must be positive"),
    ("bytes_per_s", math.nan, "bytes_per_s must be positive"),
    ("attention_flops_per_s", 0.0, "attention_flops_per_s must be positive"),
    ("latency_s", -1e-6, "latency_s must be >= 0"), ("latency_s", math.nan, "latency_s must be >= 0"),
])
def test_link_model_refuses_bad_numbers(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        LinkModel(**{field: value})


@pytest.mark.parametrize("query_tokens,pairs", [(-1, 0), (0, -1), (1.0, 0), (True, 0), (0, "3")])
def test_step_load_refuses_bad_counts(query_tokens, pairs):
    with pytest.raises(ValueError, match="StepLoad.* must be a non-negative int"):
        StepLoad(query_tokens, pairs)


@pytest.mark.parametrize("call,needle", [
    (lambda: V3.split(0), "group_size must be an int >= 1"),
    (lambda: V3.split(-8), "group_size must be an int >= 1"),
    (lambda: V3.split(8.0), "group_size must be an int >= 1"),
    (lambda: V3.owner_bytes_per_layer(-1, 8), "query_tokens must be an int >= 0"),
    (lambda: broadcast_seconds(-1, DEVICE), "broadcast_bytes must be an int >= 0"),
    (lambda: choose_mode(V3, StepLoad(1, 1), -5, 8, DEVICE), "broadcast_bytes must be an int >= 0"),
    (lambda: choose_mode(V3, StepLoad(1, 1), 5, 0, DEVICE), "group_size must be an int >= 1"),
])
def test_bad_arguments_raise_named_errors(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_inputs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        V3.num_heads = 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEVICE.bytes_per_s = 1.0


def test_attention_shape_of_the_presets():
    assert attention_shape_from_hf_config(PRESETS["deepseek-v3"]) == V3
    assert attention_shape_from_hf_config(PRESETS["deepseek-v3.2-exp"]) == V3
    assert attention_shape_from_hf_config(PRESETS["kimi-k2"]).num_heads == 64
    assert attention_shape_from_hf_config(PRESETS["deepseek-v2-lite"]).num_heads == 16
    assert attention_shape_from_hf_config(PRESETS["deepseek-v3"], "fp32").itemsize == 4


@pytest.mark.parametrize("change,needle", [
    ({"num_attention_heads": None}, "config has no num_attention_heads"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"num_attention_heads": "128"}, "num_attention_heads must be a positive integer, got '128'"),
    ({"kv_lora_rank": None}, "config has no kv_lora_rank"),
])
def test_attention_shape_needs_the_head_geometry(change, needle):
    config = {**PRESETS["deepseek-v3"], **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(AttentionGeometryError, match=needle):
        attention_shape_from_hf_config(config)
    with pytest.raises(ValueError, match="query dtype must be one of"):
        attention_shape_from_hf_config(PRESETS["deepseek-v3"], "fp8")


def test_plan_step_load_by_hand():
    # Decode: 4 requests share 4 query tokens and 100 tokens of history: each scores 25 + itself.
    assert step_load(100, 4, 4) == StepLoad(query_tokens=4, attention_pairs=4 * (25 + 1))
    # One prefill chunk of 3 tokens over 10: 3 x 10 history pairs + 1 + 2 + 3 causal pairs.
    assert step_load(10, 3, 1).attention_pairs == 36
    # Sparse attention scores at most top-k = 12 keys per query: min(11, 12) + min(12, 12) + min(13, 12).
    assert step_load(10, 3, 1, sparse_topk=12).attention_pairs == 35
    assert step_load(1_000_000, 1, 1, sparse_topk=2048).attention_pairs == 2048
    # Uneven: 3 requests, 4 tokens, 10 history -> (2 tokens, 4) + (1, 3) + (1, 3).
    assert step_load(10, 4, 3).attention_pairs == (2 * 4 + 3) + (3 + 1) + (3 + 1)
    assert step_load(0, 1, 1).attention_pairs == 1


@pytest.mark.parametrize("args,needle", [
    ((10, 2, 3), "3 requests cannot share 2 query tokens"),
    ((10, 0, 1), "batch_tokens must be an int >= 1"),
    ((-1, 1, 1), "context_tokens must be an int >= 0"),
    ((10, 1, 0), "requests must be an int >= 1"),
])
def test_plan_step_load_refuses_bad_steps(args, needle):
    with pytest.raises(ValueError, match=needle):
        step_load(*args)
    with pytest.raises(ValueError, match="sparse_topk must be None or an int >= 1"):
        step_load(10, 1, 1, sparse_topk=0)
