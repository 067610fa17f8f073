"""No host-device synchronisation in a vLLM step of a KVPP engine (`tests.support.host_sync`).

Two gloo ranks each run `step.step_forward` as vLLM's runners do, over a runtime whose cache, block
tables and metadata live on the ``meta`` device (where a host read of a device value cannot return),
under `HostSyncDetector`: on every step path (decode rows on the owner, a hybrid step, a packed
broadcast, whole layers, a step without history) nothing is read on the host, and the agreement is the
one host wait (on its host group). The control: an upload that reads a device value is caught.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.cost import AttentionShape, LinkModel
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.runtime.runtime import KVPPRuntime
from tests.support.host_sync import HostSyncDetector, HostSyncError, MetaDeviceAPI, PlantedItemAPI, VllmStep
from tests.support.launch import kvpp_group, launch

BLOCK = 16
SHAPE = AttentionShape(num_heads=4, q_width=576, out_width=512, itemsize=2)


def _runtime(world: int, api, num_blocks: int, scratch_blocks: int | None):
    comps = (ComponentSpec("kv", "bfloat16", (576,)),)
    spec = ModelCacheSpec("meta", BLOCK, tuple(LayerCacheSpec(i, comps) for i in range(4)))
    plan = KVPPPlan(spec, group_size=world, scratch_blocks=scratch_blocks)
    group = kvpp_group(world)
    storage = allocate_cache(plan, group.rank(), num_blocks, device="meta")
    return KVPPRuntime.create(plan, storage, group, device_api=api, timeout=timedelta(seconds=20),
                              agreement_group=kvpp_group(world, backend="gloo"), exchange_group=kvpp_group(world),
                              attention=SHAPE, link=LinkModel())


# (name, mode, slots, computed tokens, query tokens, decode rows, the forward's path)
PATHS = [
    ("decode rows on the owner", "owner", "compact", [40, 33, 70], [1, 1, 1], 3, "owner"),
    ("hybrid", "owner", "compact", [40, 33, 16], [1, 1, 20], 2, "hybrid"),
    ("packed broadcast", "broadcast", "compact", [40, 33, 16], [1, 1, 20], 2, "broadcast"),
    ("whole layers", "broadcast", "whole", [40, 33, 70], [1, 1, 1], 3, "broadcast"),
    ("no history", "auto", "compact", [0, 0], [30, 12], 0, "broadcast"),
]


def host_sync_ranks(rank: int, world: int, api_kind: str):
    results = {}
    for name, mode, slots, computed, query, decodes, expected in PATHS:
        api = PlantedItemAPI() if api_kind == "planted" else MetaDeviceAPI()
        whole = slots == "whole"
        # whole-layer slots past the crossover send whole layers; compact slots pack
        runtime = _runtime(world, api, num_blocks=40 if whole else 64, scratch_blocks=None if whole else 24)
        runtime.note_routing(runtime.plan.target_layers, True)
        step = VllmStep(runtime, mode)
        rows = np.arange(len(computed) * 8, dtype=np.int64).reshape(len(computed), 8)
        detector = HostSyncDetector()
        try:
            with detector:
                out = step.run(lambda: step.batch(computed, query, rows, BLOCK), decodes)
            results[name] = {"path": out["mode"], "reads": detector.reads, "host_waits": api.host_waits,
                             "pending": runtime.pending_checks, "packed": step.state.counters.packed_layers}
        except HostSyncError as exc:
            results[name] = {"error": str(exc), "reads": detector.reads}
        runtime.close()
    return results


@pytest.mark.multirank
def test_no_step_path_reads_a_device_value_on_the_host():
    results = launch(host_sync_ranks, 2, "meta", timeout_s=180)
    for rank, by_path in enumerate(results):
        for name, _, slots, _, _, _, expected in PATHS:
            got = by_path[name]
            assert "error" not in got, (rank, name, got)
            assert got["reads"] == [] and got["path"] == expected, (rank, name, got)
            assert got["host_waits"] == 0, (rank, name, got)
    # the packed paths did remap the non-owned layers' metadata, and left their device checks to be read later
    for rank in range(2):
        assert results[rank]["packed broadcast"]["packed"] > 0 and results[rank]["hybrid"]["packed"] > 0
        assert results[rank]["whole layers"]["packed"] == 0
        assert results[rank]["packed broadcast"]["pending"] == 1
        assert results[rank]["decode rows on the owner"]["pending"] == 1


@pytest.mark.multirank
def test_the_detector_catches_a_planted_host_read():
    """The negative control: the same steps, with an upload that reads a device value (``.item()``)."""
    results = launch(host_sync_ranks, 2, "planted", timeout_s=180)
    for rank in range(2):
        caught = {name for name, got in results[rank].items() if "error" in got}
        # every path that uploads a packed list reads it; the owner and whole-layer paths upload nothing
        assert caught == {"hybrid", "packed broadcast"}, (rank, results[rank])
        assert results[rank]["hybrid"]["reads"] == ["item"], results[rank]


def test_the_runners_read_a_devices_checks_before_vllm_hands_on_the_tokens():
    """`step.settled`, on what the runners' ``sample_tokens`` returns: a step's output is settled at once;
    an asynchronous output (async scheduling) when vLLM gets it, after its own wait; with nothing
    pending (CPU) the output passes untouched. A failed check raises instead of returning tokens."""
    import types

    from kvpp_fx.integrations.vllm.engine.step import settled
    from kvpp_fx.runtime.errors import OwnerRoutingError

    class Runtime:
        def __init__(self, pending: int, fails: bool = False) -> None:
            self.pending_checks, self.settled, self.fails, self.forwards, self.upto = pending, 0, fails, 3, []

        def settle(self, upto=None) -> None:
            self.settled += 1
            self.upto.append(upto)
            if self.fails:
                raise OwnerRoutingError("an owner failed")

    def engine(runtime):  # `settled` reads only the engine's runtime
        return types.SimpleNamespace(comm=types.SimpleNamespace(runtime=runtime))

    output = object()
    runtime = Runtime(pending=1)
    assert settled(engine(runtime), output) is output and runtime.settled == 1
    runtime = Runtime(pending=1)
    async_output = types.SimpleNamespace(get_output=lambda: "tokens")
    assert settled(engine(runtime), async_output) is async_output
    assert runtime.settled == 0  # nothing read before vLLM asks for the tokens
    runtime.forwards = 4  # the next step's forward began meanwhile: its checks are not this step's
    assert async_output.get_output() == "tokens" and runtime.settled == 1 and runtime.upto == [3]
    runtime = Runtime(pending=0)
    assert settled(engine(runtime), output) is output and runtime.settled == 0
    failing = Runtime(pending=1, fails=True)
    with pytest.raises(OwnerRoutingError):
        settled(engine(failing), output)
