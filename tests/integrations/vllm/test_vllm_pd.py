"""Prefill/decode pairs with a KVPP prefill instance, over vLLM's ExampleConnector, NixlConnector and
MooncakeConnector: the decode instance's tokens and cache rows against a replicated prefill instance's,
and the fault connectors' refusals.

Each fixture here starts its engines once, in a check interpreter of its own (`engine_runs`); the
model is the session's tiny DeepSeek-V3 (`conftest.tiny_deepseek`) unless the fixture makes its own.
"""

import contextlib
import json
import random
import socket
from pathlib import Path

import pytest

from kvpp_fx.integrations.vllm.setup.config import KVPP_CONNECTOR_MODULE
from tests.integrations.vllm.engine_runs import EAGER, NO_HISTORY_ROWS, run_check
from tests.integrations.vllm.tiny_model import NUM_LAYERS, make_tiny_deepseek

pytestmark = pytest.mark.vllm


# Prompts whose length minus one is not a multiple of 16: the token count ExampleConnector's producer
# saves ((n - 1) // 16 * 16) is then the one its consumer looks up ((n - 2) // 16 * 16).
PD_PROMPTS = [[(7 * i + 3) % 500 for i in range(300)], [(5 * i + 1) % 500 for i in range(100)],
              [(3 * i + 2) % 500 for i in range(181)]]


@pytest.fixture(scope="module")
def pd_runs(tmp_path_factory):
    """Prefill/decode pairs over vLLM's ExampleConnector (`kv_transfer_checks.pd_example`) on a dense tiny
    DeepSeek (vLLM CPU's fused MoE is not repeatable run to run): TP 2 producers, eager, with KVPP off,
    on, and on with the fault connector (each rank saves the layers it does not own, after the forward),
    then one TP 1 consumer with KVPP off decoding from each one's files. (With a connector KVPP keeps
    whole-layer slots: loaded tokens are history a compact slot may not hold.)"""
    model = make_tiny_deepseek(tmp_path_factory.mktemp("tiny_dense"), moe_layers=0)
    kvpp = {"enable_kvpp": True}
    spec = {"storage": str(tmp_path_factory.mktemp("pd")), "prompts": PD_PROMPTS,
            "producers": {"off": {**NO_HISTORY_ROWS, **EAGER},
                          "kvpp": {**NO_HISTORY_ROWS, **EAGER, "additional_config": kvpp},
                          "non-owners-save": {**NO_HISTORY_ROWS, **EAGER, "additional_config": kvpp,
                                              "kv_connector_module_path": "tests.support.connectors"}},
            "consumer": {**NO_HISTORY_ROWS, **EAGER}}
    return run_check("pd_example", model, json.dumps(spec), timeout=900)


def test_pd_consumer_decodes_a_kvpp_producers_kv_as_a_replicated_ones(pd_runs):
    off, kvpp = pd_runs["producers"]["off"], pd_runs["producers"]["kvpp"]
    assert "error" not in off and "error" not in kvpp, off.get("error", "") + kvpp.get("error", "")
    assert off["connector_module"] is None and kvpp["connector_module"] == KVPP_CONNECTOR_MODULE
    assert [stats["owned_layers"] for stats in kvpp["stats"]] == [[0, 1, 2], [3, 4, 5]]
    # One file per prompt and layer, each written from its owner's cache: the bytes of the replicated run.
    assert len(off["files"]) == len(PD_PROMPTS) * NUM_LAYERS
    assert sorted(f for f in off["files"] if kvpp["files"].get(f) != off["files"][f]) == []
    consumer = pd_runs["consumer"]
    assert consumer["kvpp"]["tokens"] == consumer["off"]["tokens"]
    assert all(len(t) == 12 for t in consumer["off"]["tokens"]) and len(set(consumer["off"]["tokens"][0])) > 1
    # ExampleConnector's consumer loads (n - 2) // 16 * 16 tokens of an n-token prompt, in blocks of 16.
    loaded = sum((len(p) - 2) // 16 * 16 for p in PD_PROMPTS)
    assert consumer["off"]["external_hits"] == consumer["kvpp"]["external_hits"] == loaded
    # The producers ran the prompts again, loading them from their own files: on a KVPP rank, only the
    # layers it owns.
    assert off["reloaded"]["external_hits"] == kvpp["reloaded"]["external_hits"] == loaded
    assert kvpp["reloaded"]["tokens"] == off["reloaded"]["tokens"]


def test_pd_producer_ranks_saving_layers_they_do_not_own_change_the_kv_and_the_tokens(pd_runs):
    off, faulty = pd_runs["producers"]["off"], pd_runs["producers"]["non-owners-save"]
    assert "error" not in faulty, faulty["error"]
    assert faulty["connector_module"] == "tests.support.connectors"
    assert set(faulty["files"]) == set(off["files"])
    assert any(faulty["files"][f] != off["files"][f] for f in off["files"])
    # Loading its files again puts each layer into its non-owner's scratch slot, not into the owner's cache.
    assert faulty["reloaded"]["tokens"] != off["reloaded"]["tokens"]
    assert pd_runs["consumer"]["non-owners-save"]["tokens"] != pd_runs["consumer"]["off"]["tokens"]


NIXL_PROMPTS = [[(7 * i + 3) % 500 for i in range(300)], [(5 * i + 1) % 500 for i in range(100)]]


@pytest.fixture(scope="module")
def nixl_pairs(tmp_path_factory):
    """Prefill/decode pairs over vLLM's NixlConnector, UCX on loopback (`kv_transfer_checks.nixl_pair`), on the
    dense tiny DeepSeek, eager, a TP 2 producer read by a TP 1 decode instance with KVPP off and KVPP's
    NixlConnector (named by module path): the producer with KVPP off (the reference: every rank names
    every layer), on (vLLM's connector name, which the plugin routes), and on with the fault connector
    (rank 0 also exposes layer 3, which rank 1 owns); and the producer with KVPP on read by vLLM's own
    NixlConnector."""
    model = make_tiny_deepseek(tmp_path_factory.mktemp("tiny_dense"), moe_layers=0)
    args = {**NO_HISTORY_ROWS, **EAGER}
    kvpp = {**args, "additional_config": {"enable_kvpp": True}}
    kvpp_decode = {**args, "kv_connector_module_path": KVPP_CONNECTOR_MODULE}
    pairs = {"off": (args, kvpp_decode), "kvpp": (kvpp, kvpp_decode),
             "rank-0-exposes-layer-3": ({**kvpp, "kv_connector_module_path": "tests.support.connectors"}, kvpp_decode),
             "vllms-reader": (kvpp, args)}
    return {name: run_check("nixl_pair", model, json.dumps({
        "ports": _free_ports(2), "producer": producer, "decode": decode, "prompts": NIXL_PROMPTS}),
        timeout=600) for name, (producer, decode) in pairs.items()}


def test_nixl_decode_reads_each_layer_from_its_owner_with_the_tokens_and_rows_of_kvpp_off(nixl_pairs):
    off, kvpp = nixl_pairs["off"], nixl_pairs["kvpp"]
    assert "error" not in off and "error" not in kvpp, off.get("traceback", "") + kvpp.get("traceback", "")
    assert kvpp["producer"]["connector_module"] == KVPP_CONNECTOR_MODULE
    assert off["producer"]["connector_module"] is None
    assert [stats["owned_layers"] for stats in kvpp["producer"]["stats"]] == [[0, 1, 2], [3, 4, 5]]
    assert all(len(t) == 12 for t in off["tokens"]) and len(set(off["tokens"][0])) > 1
    assert kvpp["tokens"] == off["tokens"]
    # Every layer's cache in the decode instance, byte for byte: rank 0 holds only layers 0-2, so layers
    # 3-5 came from rank 1.
    assert len(off["kv"]) == NUM_LAYERS and kvpp["kv"] == off["kv"]
    # vLLM's NixlConnector loads every prompt token (it keeps back none for the decode to recompute: no
    # Mamba layer, no multi-token MTP lookahead; `_get_remote_prefill_token_count`).
    assert off["external_hits"] == kvpp["external_hits"] == sum(len(p) for p in NIXL_PROMPTS)


def test_nixl_decode_refuses_a_prefill_rank_that_exposes_a_layer_it_does_not_own(nixl_pairs):
    faulty = nixl_pairs["rank-0-exposes-layer-3"]
    assert faulty["producer"]["connector_module"] == "tests.support.connectors"
    # Layer 3 is named by both ranks: rank 0's copy is a scratch slot. The decode instance reads nothing.
    assert "tokens" not in faulty and "KVPPConnectorError" in faulty["error"], faulty.get("traceback")
    assert "'model.layers.3.self_attn.attn': [0, 1]" in faulty["error"], faulty["error"]


def test_nixl_decode_with_vllms_own_reader_is_told_to_name_kvpps_connector(nixl_pairs):
    stock = nixl_pairs["vllms-reader"]
    # vLLM's reader refuses the handshake in its own thread: the requests end without tokens (their prompts
    # were counted as external hits when scheduled), and the error it logs shows the hash the KVPP prefill
    # rank publishes, which says what to set.
    assert stock["tokens"] == [[]] * len(NIXL_PROMPTS)
    assert any("NIXL compatibility hash mismatch" in e and "a KVPP prefill instance" in e
               and f"kv_connector_module_path={KVPP_CONNECTOR_MODULE!r}" in e for e in stock["errors"]), stock["errors"]
    assert nixl_pairs["kvpp"]["errors"] == nixl_pairs["off"]["errors"] == []


@pytest.fixture(scope="module")
def mooncake_runs(tmp_path_factory):
    """Prefill/decode pairs over vLLM's MooncakeConnector, TCP on loopback (`kv_transfer_checks.mooncake_pairs`),
    on the dense tiny DeepSeek, eager: one TP 1 decode instance with KVPP off and vLLM's own connector
    takes the prompts from, in turn, a TP 2 prefill instance with KVPP off (the reference: rank 0 writes
    every layer), on (vLLM's connector name, which the plugin routes), and on with the fault connector
    (rank 0 also registers its scratch slot of layer 3, which rank 1 owns)."""
    model = make_tiny_deepseek(tmp_path_factory.mktemp("tiny_dense"), moe_layers=0)
    args = {**NO_HISTORY_ROWS, **EAGER}
    kvpp = {**args, "additional_config": {"enable_kvpp": True}}
    producers = {"off": args, "kvpp": kvpp,
                 "rank-0-sends-layer-3": {**kvpp, "kv_connector_module_path": "tests.support.connectors"}}
    return run_check("mooncake_pairs", model, json.dumps({
        "ports": _free_ports(len(producers)), "producers": producers, "decode": args, "prompts": NIXL_PROMPTS}),
        timeout=600)


def test_mooncake_decode_receives_each_layer_from_its_owner_with_the_tokens_and_rows_of_kvpp_off(mooncake_runs):
    off, kvpp = mooncake_runs["off"], mooncake_runs["kvpp"]
    assert off["errors"] == [] and kvpp["errors"] == [], off["errors"] + kvpp["errors"]
    assert off["producer"]["connector_module"] is None
    assert kvpp["producer"]["connector_module"] == KVPP_CONNECTOR_MODULE
    assert [stats["owned_layers"] for stats in kvpp["producer"]["stats"]] == [[0, 1, 2], [3, 4, 5]]
    assert off["finish_reasons"] == ["length"] * len(NIXL_PROMPTS)
    assert all(len(t) == 12 for t in off["tokens"]) and len(set(off["tokens"][0])) > 1
    assert kvpp["tokens"] == off["tokens"]
    # Every row of every layer in the decode instance after each request, byte for byte at its position
    # (block of the request's table, row in the block): layers 3-5 came from rank 1. A request's rows: its
    # prompt's and those of the 11 tokens fed back, at positions 0 to len(prompt) + 10, and nothing else.
    assert kvpp["kv"] == off["kv"], _differing_rows(kvpp["kv"], off["kv"])[:20]
    for prompt, (rank_0,) in zip(NIXL_PROMPTS, off["kv"], strict=True):
        assert len(rank_0) == NUM_LAYERS
        assert all(_written(layer) == len(prompt) + 11 for layer in rank_0.values()), prompt
    # vLLM's MooncakeConnector loads every prompt token of an attention-only model.
    assert off["external_hits"] == kvpp["external_hits"] == sum(len(p) for p in NIXL_PROMPTS)


def test_mooncake_prefill_rank_refuses_to_send_a_layer_it_does_not_own(mooncake_runs):
    faulty, off = mooncake_runs["rank-0-sends-layer-3"], mooncake_runs["off"]
    assert faulty["producer"]["connector_module"] == "tests.support.connectors"
    # Rank 0 registered its scratch slot of layer 3: it refuses each decode request by name, and the decode
    # instance fails the requests (vLLM's kv_load_failure_policy "fail"); none of rank 0's rows reached it.
    refusal = ("KVPPConnectorError: prefill rank 0 was about to send layers ['model.layers.3.self_attn.attn'], "
               "which it does not own")
    assert len(faulty["errors"]) == len(NIXL_PROMPTS) and all(refusal in e for e in faulty["errors"]), faulty["errors"]
    assert faulty["finish_reasons"] == ["error"] * len(NIXL_PROMPTS) and faulty["tokens"] != off["tokens"]
    assert all(_written(rank_0[f"model.layers.{i}.self_attn.attn"]) == 0
               for (rank_0,) in faulty["kv"] for i in range(3))


@pytest.fixture(scope="module")
def mooncake_tp2_runs(tmp_path_factory):
    """`mooncake_runs` with a TP 2 decode instance, which names KVPP's MooncakeConnector by module path
    (with vLLM's, decode rank 0 would ask prefill rank 0 only), against the prefill instances with KVPP
    off and on."""
    model = make_tiny_deepseek(tmp_path_factory.mktemp("tiny_dense"), moe_layers=0)
    args = {**NO_HISTORY_ROWS, **EAGER}
    producers = {"off": args, "kvpp": {**args, "additional_config": {"enable_kvpp": True}}}
    decode = {**args, "tensor_parallel_size": 2, "kv_connector_module_path": KVPP_CONNECTOR_MODULE}
    return run_check("mooncake_pairs", model, json.dumps({
        "ports": _free_ports(len(producers)), "producers": producers, "decode": decode, "prompts": NIXL_PROMPTS}),
        timeout=600)


def test_mooncake_tp2_decode_asks_every_kvpp_prefill_rank_for_the_layers_it_owns(mooncake_tp2_runs):
    off, kvpp = mooncake_tp2_runs["off"], mooncake_tp2_runs["kvpp"]
    assert kvpp["producer"]["connector_module"] == KVPP_CONNECTOR_MODULE
    assert off["finish_reasons"] == kvpp["finish_reasons"] == ["length"] * len(NIXL_PROMPTS)
    assert all(len(t) == 12 for t in off["tokens"]) and kvpp["tokens"] == off["tokens"]
    assert off["external_hits"] == kvpp["external_hits"] == sum(len(p) for p in NIXL_PROMPTS)
    # Each decode rank holds every layer. Each row the prefill instance wrote (all but a prompt's last,
    # which the decode recomputes) is at its position, the same bytes from the owners as from the
    # replicated instance; the decode's own rows (the last prompt token's and the 11 fed back), which
    # differ from run to run on vLLM CPU at TP 2, KVPP or not, are there but not compared.
    assert _differing_rows(kvpp["kv"], off["kv"], lambda k: len(NIXL_PROMPTS[k]) - 1) == []
    for prompt, off_ranks, kvpp_ranks in zip(NIXL_PROMPTS, off["kv"], kvpp["kv"], strict=True):
        for off_rank, kvpp_rank in zip(off_ranks, kvpp_ranks, strict=True):
            assert len(off_rank) == NUM_LAYERS and kvpp_rank.keys() == off_rank.keys()
            for name, off_layer in off_rank.items():
                assert _written(off_layer) == _written(kvpp_rank[name]) == len(prompt) + 11, name


def _differing_rows(kv: list, reference: list, upto=None) -> list[tuple]:
    """(request, rank, layer, position) of each row whose bytes differ between two runs' decode caches
    (per request and rank, `kv_transfer_checks.kv_row_digests`): every position, or the first ``upto(request)``."""
    return [(k, rank, name, p)
            for k, (ranks, ref_ranks) in enumerate(zip(kv, reference, strict=True))
            for rank, (layers, ref_layers) in enumerate(zip(ranks, ref_ranks, strict=True))
            for name, ref in ref_layers.items()
            for p in range(upto(k) if upto else max(len(ref["rows"]), len(layers[name]["rows"])))
            if layers[name]["rows"][p:p + 1] != ref["rows"][p:p + 1]]


def _written(layer: dict) -> int:
    """How many rows a request wrote in a layer of the decode cache (`kv_transfer_checks.kv_row_digests`): the
    number of its first rows in block-table order that hold bytes, where every later row and every row
    outside its blocks holds none (-1 otherwise)."""
    rows = layer["rows"]
    count = next((p for p, row in enumerate(rows) if row is None), len(rows))
    return count if layer["stray"] == 0 and all(row is None for row in rows[count:]) else -1


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports below the kernel's ephemeral range, for listeners that bind them a minute
    later (NIXL's side channels bind once their engine has started): an ephemeral port can be handed to
    any outgoing connection in the meantime (gloo's, vLLM's own), and the listener then fails to bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = random.Random().sample(range(max(1024, low - 8000), low), 64)
    with contextlib.ExitStack() as stack:
        ports = []
        for port in candidates:
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports below {low}")
