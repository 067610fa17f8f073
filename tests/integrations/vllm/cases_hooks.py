"""KVPP's hooks on vLLM's worker and runner classes: what they reach, how a hook that cannot be applied is
named, the memory budget and groups before vLLM measures memory, the allocation's checks, and a device
API swapped on a running engine.

Like every `cases_*.py` file, run against vLLM's real classes in a pytest process of its own
(`test_vllm_objects.py::test_against_vllm_objects`: vLLM's import changes process-wide state; the name
keeps the main run from collecting it)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM: V2's Triton kernels, interpreted)

import contextlib
import types

import pytest
import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.integrations.vllm.setup.config import KVPPConfig
from kvpp_fx.integrations.vllm.cache.specs import plan_from_specs
from tests.integrations.vllm.mla_specs import ON, attn, mla


def test_hooks_reach_vllms_worker_and_runner_classes():
    """Both of vLLM's model runners, V1 and V2 (vLLM's default wherever Triton runs), on CPU and CUDA."""
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.gpu import model_runner as v2_runner_module
    from vllm.v1.worker.gpu_worker import Worker

    from kvpp_fx.integrations.vllm.engine import worker

    originals = {"v1": gpu_model_runner.allocate_kv_cache, "v2": attn_utils.allocate_kv_cache,
                 "bracket": v2_runner_module.set_forward_context}

    def kvpp_methods(cls):  # what KVPP's classes define, the adapter's and the base the adapters share
        return {name for kvpp in cls.__mro__ if kvpp.__module__.startswith("kvpp_fx.") for name in vars(kvpp)}

    for base in (CPUWorker, Worker):
        assert issubclass(worker.kvpp_worker_class(base), base)
    for base in (CPUModelRunner, gpu_model_runner.GPUModelRunner):
        hooked, kind = worker.kvpp_runner_class(base)
        assert issubclass(hooked, base) and kind == "V1"
        assert {"_model_forward", "initialize_kv_cache_tensors", "load_model"} <= kvpp_methods(hooked)
    for base in (CPUModelRunnerV2, v2_runner_module.GPUModelRunner):
        hooked, kind = worker.kvpp_runner_class(base)
        assert issubclass(hooked, base) and kind == "V2"
        assert {"execute_model", "prepare_attn", "initialize_kv_cache", "load_model", "update_requests"} <= \
            kvpp_methods(hooked)
    # vLLM's own allocator and forward context still run whenever no KVPP runner is allocating or stepping.
    assert gpu_model_runner.allocate_kv_cache is not originals["v1"]
    assert gpu_model_runner.allocate_kv_cache.__wrapped__ is originals["v1"]
    assert attn_utils.allocate_kv_cache.__wrapped__ is originals["v2"]
    assert v2_runner_module.set_forward_context.__wrapped__ is originals["bracket"]
    qualname = worker.hooked_worker_qualname("vllm.v1.worker.gpu_worker.Worker")
    assert worker.__getattr__(qualname.rsplit(".", 1)[1]) is worker.kvpp_worker_class(Worker)


def test_a_hook_that_cannot_be_applied_names_vllm_version_and_hook():
    import vllm

    from kvpp_fx.integrations.vllm.engine import worker

    class NoBudget:
        def init_device(self): ...
        def load_model(self): ...

    with pytest.raises(worker.KVPPHookError) as err:
        worker.kvpp_worker_class(NoBudget)
    assert f"vLLM {vllm.__version__}" in str(err.value) and "NoBudget.determine_available_memory" in str(err.value)
    with pytest.raises(worker.KVPPHookError, match="V1 and V2 GPUModelRunner"):
        worker.kvpp_runner_class(NoBudget)


def _engine_config(max_num_seqs=1024, budget=16384, speculative_tokens=None, index_topk=None):
    """What `layout.exchange_reserve` reads of a VllmConfig: DeepSeek-V3's attention (V3.2's with `index_topk`),
    bf16."""
    hf = types.SimpleNamespace(num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, index_topk=index_topk)
    speculative = None if speculative_tokens is None else types.SimpleNamespace(
        num_speculative_tokens=speculative_tokens)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_text_config=hf, hf_config=hf, dtype=torch.bfloat16),
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        speculative_config=speculative)


def test_a_gpu_budget_keeps_the_owner_exchanges_peak_for_the_most_decode_rows_a_step_has():
    """vLLM's profile run does not exchange owner rows, so the memory it measures as left for the KV cache
    never held them: on a device KVPP keeps the owner call's peak for max_num_seqs requests (each with its
    speculative tokens, within the token budget; an SFA model's whole token budget) out of the KV budget."""
    from kvpp_fx.cache.cost import AttentionShape
    from kvpp_fx.integrations.vllm.cache.layout import budget, exchange_reserve
    from kvpp_fx.integrations.vllm.engine.state import AttentionChoices, EngineState, KVPPAllocationError

    shape = AttentionShape(128, 576, 512, 2)
    state = EngineState(KVPPConfig(enable_kvpp=True, tp=8), None)
    assert exchange_reserve(_engine_config(), state, "cuda") == shape.owner_exchange_peak_bytes(1024, 8)
    assert exchange_reserve(_engine_config(speculative_tokens=1), state, "cuda") == \
        shape.owner_exchange_peak_bytes(2048, 8)
    assert exchange_reserve(_engine_config(budget=1500, speculative_tokens=1), state, "cuda") == \
        shape.owner_exchange_peak_bytes(1500, 8)
    # an SFA model's steps send every row to the owners, prefills included: the whole token budget
    assert exchange_reserve(_engine_config(index_topk=2048), state, "cuda") == shape.owner_exchange_peak_bytes(16384, 8)
    assert exchange_reserve(_engine_config(), state, "cpu") == 0  # vLLM CPU's KV space is a fixed size
    blocked = EngineState(KVPPConfig(enable_kvpp=True, tp=8), None, attention=AttentionChoices(owner_blocker="AMX_MLA"))
    assert exchange_reserve(_engine_config(), blocked, "cuda") == 0
    runner = types.SimpleNamespace(vllm_config=_engine_config(), device=torch.device("cpu"))
    runner.device = "cuda"
    with pytest.raises(KVPPAllocationError, match="owner-mode exchanges need up to 606076946 bytes"):
        budget(runner, state, 600_000_000)


def test_kvpp_workers_make_their_groups_before_vllm_measures_memory(monkeypatch):
    """NCCL allocates a communicator's buffers at its first collectives: KVPP's groups exist and have run
    them before vLLM's worker measures the memory left for the KV cache, so the measurement holds them."""
    from kvpp_fx.integrations.vllm.cache import allocation, layout

    from kvpp_fx.integrations.vllm.engine import worker
    order = []
    state = types.SimpleNamespace(active=contextlib.nullcontext)

    class Worker:
        def init_device(self): ...
        def load_model(self): ...
        def initialize_from_config(self, kv_cache_config): ...
        def compile_or_warm_up_model(self): ...

        def determine_available_memory(self):
            order.append("vLLM measures")
            return 1 << 30

    monkeypatch.setattr(allocation, "connect", lambda engine, device: order.append(("connect", engine, device)))
    monkeypatch.setattr(layout, "budget", lambda runner, engine, available: available)
    hooked = worker.kvpp_worker_class(Worker)()
    hooked.model_runner = types.SimpleNamespace(_kvpp=state, device="cuda:3")
    assert hooked.determine_available_memory() == 1 << 30
    assert order == [("connect", state, "cuda:3"), "vLLM measures"]


@pytest.mark.parametrize("block_size,kernel", [(128, 64), (64, 64)])
def test_a_block_size_the_backend_splits_into_kernel_blocks_is_refused_before_allocation(block_size, kernel,
                                                                                         monkeypatch):
    """FlashMLA reads 64-token kernel blocks; vLLM splits larger cache blocks into them, and its metadata
    tables then hold kernel block ids, which KVPP's positions and remapped tables do not count."""
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    from kvpp_fx.integrations.vllm.cache.allocation import KernelBlockSizeError, allocating, install_allocator

    specs = {attn(i): mla(block_size=block_size) for i in range(2)}
    group = KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=mla(block_size=block_size))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    sizes = prepare_kernel_block_sizes(config, [[AttentionGroup(FlashMLABackend, list(specs), group.kv_cache_spec, 0)]])
    assert sizes == [kernel]  # vLLM's choice of kernel block size
    install_allocator(attn_utils.__name__)  # V2's call site; V1's passes the same arguments
    allocated = []  # KVPP's allocation, after the check
    monkeypatch.setattr("kvpp_fx.integrations.vllm.cache.allocation.allocate",
                        lambda runner, state, cfg, device: allocated.append(cfg))
    with allocating(None, None):
        if kernel != block_size:
            with pytest.raises(KernelBlockSizeError, match=f"Set block_size={kernel} "):
                attn_utils.allocate_kv_cache(config, torch.device("cpu"), "NHD", sizes)
        else:
            attn_utils.allocate_kv_cache(config, torch.device("cpu"), "NHD", sizes)
    assert allocated == ([] if kernel != block_size else [config])


def test_post_allocation_self_check_catches_unbound_layers_and_block_mismatch():
    from kvpp_fx.integrations.vllm.cache.allocation import self_check
    from kvpp_fx.integrations.vllm.engine.state import EngineState, KVPPAllocationError, Layout

    specs = {attn(i): mla() for i in range(3)}
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=mla())])
    state = EngineState(ON, None, layout=Layout(vplan=plan_from_specs(specs, 2, 3), budget_blocks=8))
    storage = allocate_cache(state.plan, 0, 8)
    state.comm.runtime = types.SimpleNamespace(storage=storage)  # the check reads only the storage
    layers = {name: types.SimpleNamespace(kv_cache=storage.typed_views(i)["kv"]) for i, name in enumerate(specs)}
    runner = types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context=layers),
                                   get_kv_cache_spec=lambda: specs)
    self_check(runner, state, config)
    layers[attn(1)].kv_cache = storage.typed_views(1)["kv"].clone()  # vLLM's own tensor, not KVPP's view
    with pytest.raises(KVPPAllocationError, match="'model.layers.1.self_attn.attn' is not bound"):
        self_check(runner, state, config)
    layers[attn(1)].kv_cache = storage.typed_views(1)["kv"]
    # vLLM gives every worker the smallest count any worker's budget holds (pipeline stages differ).
    state.layout.budget_blocks = 9
    self_check(runner, state, config)
    state.layout.budget_blocks = 7
    with pytest.raises(KVPPAllocationError, match="vLLM planned 8 blocks, the KVPP budget holds 7"):
        self_check(runner, state, config)


def test_a_device_api_that_does_not_load_leaves_the_engine_its_runtime():
    """``kvpp_set_device_api`` builds the new runtime before it closes the old one: a factory that does not
    import raises, and the engine keeps its open runtime and its device API (a closed one would fail every
    later step). The control: a factory that loads replaces the runtime and closes the old one."""
    from kvpp_fx.integrations.vllm.cache import allocation
    from kvpp_fx.integrations.vllm.engine.state import Communication, EngineState, Layout
    from kvpp_fx.runtime.runtime import KVPPRuntime
    from tests.passes import toy

    plan = toy.toy_plan(4)
    hf = types.SimpleNamespace(num_attention_heads=4, kv_lora_rank=8, qk_rope_head_dim=4)
    vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_text_config=hf, dtype=torch.float32))
    runtime = KVPPRuntime.create(plan, toy.allocate(plan))
    state = EngineState(ON, vllm_config, comm=Communication(runtime=runtime),
                        layout=Layout(vplan=types.SimpleNamespace(plan=plan)))
    with pytest.raises(ModuleNotFoundError):
        allocation.set_device_api(state, "tests.support.no_such_module:api")
    assert state.comm.runtime is runtime and not runtime._closed and state.comm.device_api_factory is None
    allocation.set_device_api(state, "tests.support.faults:UnremappedTables")
    assert state.comm.runtime is not runtime and runtime._closed and not state.comm.runtime._closed
    assert state.comm.device_api_factory == "tests.support.faults:UnremappedTables"
    state.comm.runtime.close()
