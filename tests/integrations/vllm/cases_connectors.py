"""KV connectors with vLLM's classes: the names and roles KVPP accepts, routing to KVPP's classes, which
rank exposes or sends a layer (ExampleConnector, NixlConnector, MooncakeConnector), and the readers
that ask every prefill rank.

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`: vLLM's import changes process-wide state; the name
keeps the main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import types

import pytest

from kvpp_fx.integrations.vllm.setup.config import (
    KVPP_CONNECTOR_MODULE,
    KVPP_VLLM_CONNECTORS,
    MSG_DECODE_NODE,
    MSG_NOT_KVPP_CONNECTOR,
    MSG_PRODUCER_ONLY,
    MSG_VLLM_CONNECTOR,
    VLLM_CONNECTORS,
    Deployment,
)
from kvpp_fx.integrations.vllm.cache.specs import plan_from_specs
from tests.integrations.vllm.mla_specs import ON, attn, mla


def test_connector_names_are_vllms():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert set(VLLM_CONNECTORS) == set(KVConnectorFactory._registry)
    assert "MooncakeConnectorV2" not in KVConnectorFactory._registry  # vllm-ascend's, KVPP-aware


@pytest.mark.parametrize("name,role,message", [
    ("OffloadingConnector", "kv_both", MSG_VLLM_CONNECTOR.format(name="OffloadingConnector")),
    ("MooncakeStoreConnector", "kv_producer", MSG_VLLM_CONNECTOR.format(name="MooncakeStoreConnector")),
    ("MooncakeConnector", "kv_both", MSG_PRODUCER_ONLY.format(name="MooncakeConnector")),
    ("MooncakeConnectorV2", "kv_consumer", MSG_DECODE_NODE),
])
def test_connector_rule_reads_kv_transfer_config(name, role, message):
    from vllm.config import KVTransferConfig

    config = types.SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector=name, kv_role=role))
    with pytest.raises(ValueError) as err:
        ON.validate(Deployment.from_vllm_config(config))
    assert str(err.value) == message


@pytest.mark.parametrize("prefill_tp,decode_tp,missed", [
    (2, 1, [[]]), (2, 2, [[1], [0]]), (4, 2, [[2, 3], [0, 1]]), (2, 4, [[1], [1], [0], [0]]),
])
def test_mooncake_decode_ranks_that_would_miss_a_kvpp_prefill_ranks_layers(prefill_tp, decode_tp, missed):
    from kvpp_fx.integrations.vllm.kv_connectors.mooncake import ranks_not_asked

    # vLLM's MLA pairing: a decode rank asks every prefill rank only where the decode instance has TP 1.
    assert [ranks_not_asked(prefill_tp, rank, decode_tp) for rank in range(decode_tp)] == missed


def _mooncake_worker(tp_rank, tp_size, registered, owned):
    from kvpp_fx.integrations.vllm.kv_connectors.mooncake import KVPPMooncakeWorker

    worker = object.__new__(KVPPMooncakeWorker)  # no transfer engine: only the checks before vLLM's planning
    worker.tp_rank, worker.tp_size, worker.registered_layer_names = tp_rank, tp_size, registered
    worker._owned = frozenset(owned)
    return worker


def test_a_kvpp_mooncake_rank_refuses_a_decode_rank_that_asks_only_some_prefill_ranks():
    worker = _mooncake_worker(0, 2, ["layer.0"], ["layer.0"])
    meta = types.SimpleNamespace(remote_tp_rank=0, remote_tp_size=2, asks_every_rank=False)
    local, remote, error = worker._prepare_transfer_regions(meta)
    assert (local, remote) == ([], [])
    assert error.startswith("KVPPConnectorError: decode rank 0 (TP 2) asks only some ranks") and "ranks [1]" in error
    assert "kv_connector_module_path='kvpp_fx.integrations.vllm.connectors' on the decode instance" in error


def test_a_kvpp_mooncake_rank_refuses_to_send_a_layer_it_does_not_own():
    worker = _mooncake_worker(0, 2, ["layer.0", "layer.3"], ["layer.0"])
    meta = types.SimpleNamespace(remote_tp_rank=0, remote_tp_size=1, asks_every_rank=False)
    local, remote, error = worker._prepare_transfer_regions(meta)
    assert (local, remote) == ([], [])
    assert error == ("KVPPConnectorError: prefill rank 0 was about to send layers ['layer.3'], which it does not "
                     "own: its binding of them is a scratch slot.")


def _transfer(**fields):
    from vllm.config import KVTransferConfig

    return types.SimpleNamespace(kv_transfer_config=KVTransferConfig(**fields))


def test_each_kvpp_connector_is_vllms_class_of_that_name():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvpp_fx.integrations.vllm import connectors
    from kvpp_fx.integrations.vllm.kv_connectors.base import KVPPConnector

    # The module vLLM's factory reads names exactly KVPP's classes of these connectors.
    assert sorted(connectors.__all__) == sorted(KVPP_VLLM_CONNECTORS)
    for name in KVPP_VLLM_CONNECTORS:
        ours = getattr(connectors, name)
        assert issubclass(ours, KVConnectorFactory.get_connector_class_by_name(name)), name
        assert issubclass(ours, KVPPConnector)
    assert connectors.NixlPullConnector is connectors.NixlConnector  # vLLM's NixlConnector is its pull connector


def test_routing_has_vllms_factory_build_kvpps_class():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvpp_fx.integrations.vllm import connectors
    from kvpp_fx.integrations.vllm.kv_connectors.routing import route_connector

    config = _transfer(kv_connector="ExampleConnector", kv_role="kv_producer")
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is not connectors.ExampleConnector
    route_connector(config)
    assert config.kv_transfer_config.kv_connector_module_path == KVPP_CONNECTOR_MODULE
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is connectors.ExampleConnector
    ON.validate(Deployment.from_vllm_config(config))  # the second validation, after routing


def test_a_connector_module_must_hold_a_kvpp_connector():
    from kvpp_fx.integrations.vllm.kv_connectors.routing import route_connector

    vllms = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
    config = _transfer(kv_connector="ExampleConnector", kv_role="kv_producer", kv_connector_module_path=vllms)
    with pytest.raises(ValueError) as err:
        route_connector(config)
    assert str(err.value) == MSG_NOT_KVPP_CONNECTOR.format(name="ExampleConnector", module=vllms)
    # A subclass of KVPP's (the PD test's fault connector) is left as named.
    faulty = _transfer(kv_connector="ExampleConnector", kv_role="kv_producer",
                       kv_connector_module_path="tests.support.connectors")
    route_connector(faulty)
    assert faulty.kv_transfer_config.kv_connector_module_path == "tests.support.connectors"


@pytest.mark.parametrize("role,message", [("kv_both", MSG_PRODUCER_ONLY.format(name="ExampleConnector")),
                                          ("kv_consumer", MSG_DECODE_NODE)])
def test_a_kvpp_connector_runs_only_on_a_producer(role, message):
    with pytest.raises(ValueError) as err:
        ON.validate(Deployment.from_vllm_config(_transfer(kv_connector="ExampleConnector", kv_role=role)))
    assert str(err.value) == message


def test_a_layer_is_exposed_by_its_owner_and_a_draft_layer_by_the_first_rank():
    from kvpp_fx.integrations.vllm.engine.state import Communication, EngineState, Layout
    from kvpp_fx.integrations.vllm.kv_connectors import base

    specs = {attn(i): mla() for i in range(5)}  # 4 target layers and a draft layer (index 4)
    vplan = plan_from_specs(specs, 2, 4)
    exposed = {}
    for rank in (0, 1):
        # The connector reads only the rank of the engine's runtime.
        state = EngineState(ON, None, layout=Layout(vplan=vplan),
                            comm=Communication(runtime=types.SimpleNamespace(rank=rank)))
        with state.active():
            exposed[rank] = [i for i in range(5) if base.kept_here("ExampleConnector", attn(i))]
            with pytest.raises(base.KVPPConnectorError, match="plan does not hold"):
                base.kept_here("ExampleConnector", attn(9))
    assert exposed == {0: [0, 1, 4], 1: [2, 3]}
    with pytest.raises(base.KVPPConnectorError, match="outside a KVPP step"):
        base.kept_here("ExampleConnector", attn(0))
    # A connector of an engine with KVPP on asks; with KVPP off (a decode instance) every layer is its own.
    on, off = base.KVPPConnector(), base.KVPPConnector()
    for connector, enabled in ((on, True), (off, False)):
        connector._vllm_config = types.SimpleNamespace(
            additional_config={"enable_kvpp": enabled}, parallel_config=types.SimpleNamespace(tensor_parallel_size=2))
    assert off.exposes(attn(0))
    with pytest.raises(base.KVPPConnectorError, match="outside a KVPP step"):
        on.exposes(attn(0))


def test_a_nixl_rank_that_names_some_layers_is_read_as_one_with_all():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlAgentMetadata

    from kvpp_fx.integrations.vllm.kv_connectors.nixl import padded_to

    names = [attn(i) for i in range(4)]
    # Rank 1 of a KVPP prefill instance: layers 2 and 3, one region each.
    meta = NixlAgentMetadata(
        engine_id="prefill", agent_metadata=b"", kv_caches_base_addr=[2000, 3000], device_id=0, num_blocks=8,
        block_lens=[9216, 9216], block_strides=[9216, 9216], kv_cache_layout="NHD", block_size=16, ssm_sizes=(0, 0),
        attn_backend_name="CPU_MLA", physical_blocks_per_logical_kv_block=1, region_num_blocks=[8, 8],
        region_group_ids=[0, 0], region_names=names[2:], region_mem_types=["DRAM", "DRAM"],
        region_members=[[names[2]], [names[3]]])
    padded = padded_to(meta, names)
    assert padded.region_names == names and padded.region_members == [[n] for n in names]
    # Layers 0 and 1 repeat its first region (never addressed: no read of this rank selects them).
    assert padded.kv_caches_base_addr == [2000, 2000, 2000, 3000]
    assert padded.block_lens == padded.block_strides == [9216] * 4
    assert padded.region_num_blocks == [8] * 4 and padded.region_mem_types == ["DRAM"] * 4
    assert meta.region_names == names[2:]  # the remote's own metadata is left as it came


def test_a_kvpp_nixl_reader_handshakes_with_every_remote_rank():
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology

    from kvpp_fx.integrations.vllm.kv_connectors.base import AllRanksTopology

    fields = dict(tp_rank=1, tp_size=2, block_size=16, engine_id="decode", is_mla=True, is_mamba=False,
                  total_num_kv_heads=1, attn_backends=[])
    assert TransferTopology(**fields).handshake_target_ranks(2) == [1]  # vLLM: MLA reads one rank
    assert AllRanksTopology(**fields).handshake_target_ranks(2) == [0, 1]
    assert AllRanksTopology(**dict(fields, tp_rank=0, tp_size=1)).handshake_target_ranks(4) == [0, 1, 2, 3]


def test_a_retyped_topology_keeps_every_field_of_vllms():
    """The NIXL and Mooncake workers' topologies are vLLM's, retyped: every field vLLM's `TransferTopology`
    declares keeps its value. The control: a class that is not a topology is refused."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology

    from kvpp_fx.integrations.vllm.kv_connectors.base import AllRanksTopology, retyped_topology
    from kvpp_fx.integrations.vllm.kv_connectors.mooncake import _ReaderTopology

    vllms = TransferTopology(tp_rank=1, tp_size=2, block_size=16, engine_id="decode", is_mla=True, is_mamba=False,
                             total_num_kv_heads=1, attn_backends=[])
    for cls in (AllRanksTopology, _ReaderTopology):
        retyped = retyped_topology(vllms, cls)
        assert type(retyped) is cls
        assert {f.name: getattr(retyped, f.name) for f in dataclasses.fields(TransferTopology)} == {
            f.name: getattr(vllms, f.name) for f in dataclasses.fields(TransferTopology)}
    with pytest.raises(TypeError, match="not a subclass"):
        retyped_topology(vllms, dict)


def test_a_kvpp_mooncake_reader_marks_requests_it_asks_of_every_prefill_rank_and_vllm_ignores_the_mark():
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as vllm_mooncake

    from kvpp_fx.integrations.vllm.kv_connectors import mooncake

    meta = vllm_mooncake.MooncakeXferMetadata(
        remote_hostname="127.0.0.1", remote_port=1, remote_tp_size=2, remote_tp_rank=1,
        req_blocks={"r": ("t", [[3, 4]])}, kv_caches_base_addr=[64], block_lens=[8], kv_block_lens=[8])
    encoder = mooncake._EveryRankEncoder(msgspec.msgpack.Encoder())
    kvpp_decoder = msgspec.msgpack.Decoder(mooncake.EveryRankXferMetadata)
    vllm_decoder = msgspec.msgpack.Decoder(vllm_mooncake.MooncakeXferMetadata)
    assert kvpp_decoder.decode(encoder.encode(meta)).asks_every_rank is False
    token = mooncake._ASKS_EVERY_RANK.set(True)
    try:
        marked = encoder.encode(meta)
    finally:
        mooncake._ASKS_EVERY_RANK.reset(token)
    assert kvpp_decoder.decode(marked).asks_every_rank is True
    assert vllm_decoder.decode(marked) == meta


def test_the_connector_module_imports_mooncakes_only_when_asked():
    """vLLM's factory reads every KVPP connector class from the module the plugin names; vLLM's Mooncake
    module (which warns in every process of a deployment without the ``mooncake`` package) is imported only
    when the Mooncake class is asked for. In a fresh interpreter: the control asks for it."""
    import subprocess
    import sys

    probe = ("import sys; import kvpp_fx.integrations.vllm.connectors as c; "
             "print(sorted(m for m in sys.modules if m.endswith('mooncake') or m.endswith('mooncake_connector'))); "
             "c.MooncakeConnector; "
             "print(sorted(m for m in sys.modules if m.endswith('mooncake') or m.endswith('mooncake_connector')))")
    before, after = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                   timeout=300).stdout.strip().splitlines()[-2:]
    assert before == "[]", before
    assert "kvpp_fx.integrations.vllm.kv_connectors.mooncake" in after, after
