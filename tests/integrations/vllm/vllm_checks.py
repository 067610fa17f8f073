"""Checks that need vLLM, run as `python -m tests.integrations.vllm.vllm_checks NAME ARGS`: vLLM's import has
process-wide side effects, so the tests run each check in a fresh interpreter and read its JSON. One
interpreter builds several engines in turn (`generate_many`), each shut down before the next.

vLLM runs its default model runner here, V2, with its Triton kernels under Triton's interpreter
(`triton_interpreter`, imported first: vLLM's TP workers are spawned and re-run this module)."""

from __future__ import annotations

import tests.integrations.vllm.triton_interpreter  # noqa: F401, I001  (before vLLM is imported)
from tests.integrations.vllm import triton_mla_on_cpu  # noqa: I001  (TRITON_MLA on CPU, where an engine's env asks)
from tests.integrations.vllm import cpu_chunked_prefill  # noqa: I001  (MLA's chunked prefill on CPU, where asked)
from tests.integrations.vllm import mooncake_on_cpu  # noqa: F401, I001  (vLLM's MooncakeConnector on CPU, where asked)
from tests.integrations.vllm import deepseek_v4_on_cpu  # noqa: I001  (DeepSeek-V4 on vLLM CPU, where asked)
from tests.integrations.vllm import deepseek_v32_on_cpu  # noqa: I001  (DeepSeek-V3.2 on vLLM CPU, where asked)

import contextlib
import dataclasses
import functools
import gc
import json
import os
import sys

from tests.integrations.vllm.kv_transfer_checks import (mooncake_pairs, mooncake_producer, nixl_pair,
                                                       nixl_producer, pd_example)

# What vllm/v1/worker/cpu/shm.py replaces process-wide when a CPU worker module is imported.
PATCH_TARGETS = ("torch.cuda.Event", "torch.cuda.Stream", "torch.cuda.current_stream", "torch.cuda.stream",
                 "torch.accelerator.synchronize", "torch.Tensor.pin_memory", "torch.Tensor.record_stream")
PLATFORM_WORKER_MODULES = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu.shm",
                           "vllm.v1.worker.gpu_model_runner")
KVPP_HEAVY_MODULES = ("kvpp_fx.integrations.vllm.engine.worker", "kvpp_fx.ops", "kvpp_fx.runtime.runtime")


def _resolve(path: str):
    import importlib

    module, _, rest = path.partition(".")
    obj = importlib.import_module(module)
    for part in rest.split("."):
        obj = getattr(obj, part)
    return obj


def _snapshot() -> dict:
    return {path: id(_resolve(path)) for path in PATCH_TARGETS}


def _process_state(before: dict) -> dict:
    return {"replaced": sorted(p for p, ident in _snapshot().items() if ident != before[p]),
            "platform_modules": sorted(m for m in PLATFORM_WORKER_MODULES if m in sys.modules),
            "kvpp_modules": sorted(m for m in KVPP_HEAVY_MODULES if m in sys.modules)}


def plugin_off(model_dir: str) -> dict:
    """Load vLLM's general plugins and build configs with KVPP off and on; report what changed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # noqa: F401

    before = _snapshot()
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    out = {"plugin_loaded": "kvpp_fx.integrations.vllm.plugin" in sys.modules,
           "config_wrapped": bool(getattr(VllmConfig.__post_init__, "_kvpp_fx_validation", False))}
    out["after_plugins"] = _process_state(before)
    off = EngineArgs(model=model_dir, skip_tokenizer_init=True, enforce_eager=True).create_engine_config()
    out["off_worker_cls"] = off.parallel_config.worker_cls
    out["after_off_config"] = _process_state(before)
    on = EngineArgs(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, tensor_parallel_size=2,
                    additional_config={"enable_kvpp": True}).create_engine_config()
    out["on_worker_cls"] = on.parallel_config.worker_cls
    out["after_on_config"] = _process_state(before)
    import vllm.v1.worker.cpu_worker  # noqa: F401  (the control: this import does replace them)

    out["after_cpu_worker_import"] = _process_state(before)
    return out


def construct_many(cases_json: str) -> dict:
    """Build each case's engine config in this one interpreter; report the error or the config."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.engine.arg_utils import EngineArgs

    results = {}
    for name, case in json.loads(cases_json).items():
        with _environment(case.get("env", {})):
            try:
                config = EngineArgs(skip_tokenizer_init=True, **case["args"]).create_engine_config()
            except Exception as exc:  # the test compares the message
                results[name] = {"error": type(exc).__name__, "message": str(exc),
                                 "is_value_error": isinstance(exc, ValueError)}
                continue
            results[name] = {"error": None, "worker_cls": config.parallel_config.worker_cls,
                             **_compile_settings(config),
                             "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
                             "model_runner": "V2" if config.use_v2_model_runner else "V1",
                             "kv_connector_module_path": getattr(config.kv_transfer_config,
                                                                 "kv_connector_module_path", None),
                             "hash": config.compute_hash()}
            # vLLM resolves copies of a config again (the MTP drafter's, with dataclasses.replace).
            results[name]["replaced"] = _compile_settings(dataclasses.replace(config))
    return results


def _compile_settings(config) -> dict:
    return {"mode": int(config.compilation_config.mode), "backend": config.compilation_config.backend,
            "additional_config": json.loads(json.dumps(config.additional_config))}


def spec_ops(_: str = "") -> dict:
    """Whether each built-in vLLM op spec names an op the installed vLLM registers."""
    import torch
    import vllm
    import vllm.model_executor.layers.attention.mla_attention  # noqa: F401  (registers the MLA ops)
    import vllm.model_executor.layers.sparse_attn_indexer  # noqa: F401  (registers the SFA indexer op)

    from kvpp_fx.passes.registry import VLLM_SPECS

    def exists(qualified: str) -> bool:
        namespace, _, name = qualified.partition("::")
        return torch._C._dispatch_has_kernel(f"{namespace}::{name.split('.')[0]}") or hasattr(
            getattr(torch.ops, namespace), name.split(".")[0])

    return {"vllm": vllm.__version__, "specs": {spec.op: exists(spec.op) for spec in VLLM_SPECS},
            "control": exists("vllm::unified_mla_attention_that_does_not_exist")}


PROMPTS = [[(7 * i + 3) % 500 for i in range(90)], [(5 * i + 1) % 500 for i in range(70)]]
# Longer than a 256-token budget, sharing a 300-token prefix: with chunked prefill and prefix caching
# (vLLM CPU's AMX_MLA backend) later chunks and prefix hits read computed blocks.
SHARED_PREFIX = [(11 * i + 5) % 500 for i in range(300)]
FIRST_WAVE = [SHARED_PREFIX + [(3 * i + 7) % 500 for i in range(60)]]
SECOND_WAVE = [SHARED_PREFIX + [(13 * i + 2) % 500 for i in range(90)],
               SHARED_PREFIX + [(17 * i + 9) % 500 for i in range(40)]]
# 20 prompts of 33 tokens in one step: 60 blocks of 16 written, 80 once their 16 new tokens are in.
MANY_SHORT = [[(7 * i + 3 * k + 1) % 500 for i in range(33)] for k in range(20)]
WORKLOADS = {"short": [PROMPTS], "shared_prefixes": [FIRST_WAVE, SECOND_WAVE], "many_short": [MANY_SHORT]}
# A long prompt first; the two short ones join once it decodes: their prefill step carries its decode
# row (a mixed step), and long-history decodes are what "auto" sends to the owner on the CPU link.
STAGGERED = ([(7 * i + 3) % 500 for i in range(700)], [[(5 * i + 1) % 500 for i in range(120)],
                                                       [(3 * i + 2) % 500 for i in range(100)]])


# DeepSeek-V4: two short prompts decode while a prompt of 2,100 tokens (over 4 x index top-k 512: its ratio-4
# layers' indexers select) prefills next to them.
V4_STAGGERED = ([(7 * i + 3) % 500 for i in range(40)], [[(5 * i + 1) % 500 for i in range(60)],
                                                        [(11 * i + 5) % 500 for i in range(2100)]])
STAGGERED_WORKLOADS = {"staggered": STAGGERED, "v4_staggered": V4_STAGGERED}


def run_staggered(llm, params, workload: str = "staggered") -> list[list[int]]:
    """Drive the engine step by step: the first prompt's prefill, then the others join its decode."""
    engine = llm.llm_engine
    first, later = STAGGERED_WORKLOADS[workload]
    engine.add_request("staggered-0", {"prompt_token_ids": first}, params)
    done = {}
    for output in engine.step():
        done[output.request_id] = output
    for k, prompt in enumerate(later, start=1):
        engine.add_request(f"staggered-{k}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return [list(done[f"staggered-{k}"].outputs[0].token_ids) for k in range(1 + len(later))]


def generate_many(model_dir: str, variants_json: str) -> dict:
    """Each variant's engine in turn, in this one interpreter: ``{name: generate's result}``, or
    ``{name: {"error": traceback}}`` for a variant whose engine failed (the others still run).

    The engine core runs in this interpreter too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): which process
    holds the scheduler changes nothing on the workers, where KVPP runs, and it saves an interpreter per
    engine. The OpenAI server tests keep vLLM's default, an engine-core process of its own.
    """
    import traceback

    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0")
    results = {}
    for name, variant in json.loads(variants_json).items():
        try:
            results[name] = generate(model_dir, variant)
        except Exception:  # reported to the test that reads this variant
            results[name] = {"error": traceback.format_exc()}
    return results


def generate(model_dir: str, variant: dict) -> dict:
    """Greedy tokens from LLM(...) at TP 2, and what each worker's KVPP runtime saw; the engine is shut
    down before this returns.

    ``variant``: ``kvpp`` (on/off), ``args`` (more LLM arguments), ``env`` (environment variables for
    this engine, e.g. ``VLLM_USE_V2_MODEL_RUNNER``; its workers are spawned with them), ``mode3`` (the CPU
    stand-in for vLLM's mode 3, `cpu_mode3`: ``True`` for inductor pieces, or the name of vLLM's backend for
    the pieces), ``workload`` (a key of WORKLOADS: prompt waves, each one ``generate`` call), ``fault`` (a
    ``"module:callable"`` device API installed through the workers' test seam after the first run, which
    then runs again: the negative control, on the same engine), ``zero_blocks`` (`zero_blocks_probe`),
    ``v2_warm_up`` (`v2_warm_up`), ``phases`` (more runs on the same engine, each with its own mode, fault
    and workload).
    """
    from vllm import LLM, SamplingParams

    from kvpp_fx.integrations.vllm.engine.stats import worker_stats
    from tests.integrations.vllm.cpu_mode3 import keep_mode_3

    args = dict(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=2, kv_cache_memory_bytes=32 << 20,
                additional_config={"enable_kvpp": variant.get("kvpp", False)})
    args.update(variant.get("args", {}))
    with _environment(variant.get("env", {})):
        if os.environ.get(triton_mla_on_cpu.ENV):
            triton_mla_on_cpu.apply()
        if os.environ.get(cpu_chunked_prefill.ENV):
            cpu_chunked_prefill.apply()
        if os.environ.get(deepseek_v4_on_cpu.ENV):
            deepseek_v4_on_cpu.apply()
        if os.environ.get(deepseek_v32_on_cpu.ENV):
            deepseek_v32_on_cpu.apply()
        mode3 = variant.get("mode3")
        with keep_mode_3("inductor" if mode3 is True else mode3) if mode3 else contextlib.nullcontext():
            llm = LLM(**args)
        try:
            return _drive(llm, variant, worker_stats, SamplingParams)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


@contextlib.contextmanager
def _environment(values: dict):
    """`values` in os.environ while open, as they were after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _drive(llm, variant: dict, worker_stats, SamplingParams) -> dict:
    params = SamplingParams(**{"max_tokens": 16, "temperature": 0, "ignore_eos": True, **variant.get("sampling", {})})

    def run(workload: str = variant.get("workload", "short")) -> list[list[int]]:
        if workload in STAGGERED_WORKLOADS:
            return run_staggered(llm, params, workload)
        tokens = []
        for wave in WORKLOADS[workload]:
            outputs = llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
            tokens += [list(o.outputs[0].token_ids) for o in outputs]
        return tokens

    steps = _schedule_recorder(llm)

    def scheduled() -> list:
        """The steps scheduled since the last call."""
        done = list(steps)
        steps.clear()
        return done

    # At start, as on a GPU: vLLM's warm-up assumes a runner without requests.
    warm_up = llm.collective_rpc(v2_warm_up) if variant.get("v2_warm_up") else None
    result = {"v2_warm_up": warm_up, "tokens": run(), "stats": llm.collective_rpc(worker_stats),
              "num_blocks": llm.collective_rpc(vllm_num_blocks), "kv_cache_bytes": llm.collective_rpc(kv_cache_bytes),
              "config": _config_summary(llm),
              "schedule": scheduled()}
    if variant.get("args", {}).get("disable_log_stats") is False:
        result["prefix_cache_hits"] = _counter(llm, "vllm:prefix_cache_hits")
    if os.environ.get(deepseek_v32_on_cpu.ENV):
        result["indexer"] = llm.collective_rpc(deepseek_v32_on_cpu.indexer_stats)
    if variant.get("fault"):
        llm.reset_prefix_cache()
        llm.collective_rpc("kvpp_set_device_api", args=(variant["fault"],))
        result["faulty"] = run()
        result["faulty_stats"] = llm.collective_rpc(worker_stats)
        result["faulty_schedule"], result["faulty_counts"] = scheduled(), llm.collective_rpc(fault_counts)
    if variant.get("zero_blocks"):
        result["zero_blocks"] = llm.collective_rpc(zero_blocks_probe, args=(variant["zero_blocks"],))
    result["phases"] = {}
    for phase in variant.get("phases", []):
        llm.reset_prefix_cache()
        if variant.get("kvpp"):
            if phase.get("mode"):
                llm.collective_rpc("kvpp_set_mode", args=(phase["mode"],))
            llm.collective_rpc("kvpp_set_device_api", args=(phase.get("fault"),))
        scheduled()
        tokens = run(phase.get("workload", "short"))
        result["phases"][phase["name"]] = {"tokens": tokens, "stats": llm.collective_rpc(worker_stats),
                                           "schedule": scheduled(), "fault_counts": llm.collective_rpc(fault_counts)}
    return result


def _schedule_recorder(llm) -> list:
    """Every step vLLM's scheduler hands the workers from now on, as ``[[computed, scheduled], ...]``, one
    pair per request: the tokens computed before the step (what the step's attention reads as history)
    and the tokens it schedules (draft tokens included); the model runner builds the attention metadata's
    context and query lengths from exactly these. Read in the engine core, which runs in this interpreter
    (`generate_many`), independently of anything KVPP counts."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    steps: list = []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            cached = output.scheduled_cached_reqs
            computed = {request.req_id: request.num_computed_tokens for request in output.scheduled_new_reqs}
            computed.update(zip(cached.req_ids, cached.num_computed_tokens))
            steps.append([[computed[r], n] for r, n in output.num_scheduled_tokens.items()])
        return output

    scheduler.schedule = recording_schedule
    return steps


def fault_counts(_worker) -> dict:
    """What the faults of `tests.support.counted_faults` did in this worker process so far."""
    from tests.support import counted_faults

    return {name: dict(counts) for name, counts in counted_faults.COUNTS.items()}


def _config_summary(llm) -> dict:
    config = llm.llm_engine.vllm_config
    compilation = config.compilation_config
    return {"mode": int(compilation.mode), "backend": compilation.backend,
            "model_runner": "V2" if config.use_v2_model_runner else "V1",
            "splitting_ops": list(compilation.splitting_ops or []),
            "cudagraph_mode": str(compilation.cudagraph_mode), "block_size": config.cache_config.block_size,
            "max_model_len": config.model_config.max_model_len,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill),
            "prefix_caching": bool(config.cache_config.enable_prefix_caching),
            "kvpp_fx": dict(config.additional_config.get("kvpp_fx", {}))}


def zero_blocks_probe(worker, block_ids: list[int]) -> dict:
    """vLLM's block zeroer on this worker's cache, as a step with ``new_block_ids_to_zero`` runs it (vLLM
    builds it only for Mamba layers or mixed cache precision; the probe builds it as the GPU worker
    would): each view's blocks set to 1 first (a scratch slot's first blocks); then which were zeroed. The control:
    vLLM's own zeroer of the platform's runner class on the same views (V2 builds it over every view,
    V1 indexes every view by pool id)."""
    import torch

    runner = worker.model_runner
    state = runner._kvpp
    storage, plan, rank = state.comm.runtime.storage, state.plan, state.comm.runtime.rank
    views = {index: storage.typed_views(index)["kv"] for index in sorted(set(state.vplan.layer_index.values()))}
    marked = torch.as_tensor(block_ids)
    for index, view in views.items():
        view[marked if plan.is_local(index, rank) else torch.arange(min(len(block_ids), view.shape[0]))] = 1
    vllm_runner = next(cls for cls in type(runner).__mro__ if cls.__module__.startswith("vllm."))
    if state.runner_kind == "V2":  # as a step with new_block_ids_to_zero runs it, once the worker built it
        runner._init_kv_zero_meta()
        runner.kv_block_zeroer.zero_block_ids(block_ids)
        control = functools.partial(vllm_runner._init_kv_zero_meta, runner)
    else:
        runner._zero_block_ids(block_ids)
        control = functools.partial(vllm_runner._zero_block_ids, runner, block_ids)
    out = {"persistent_zeroed": all(bool((view[marked] == 0).all()) for index, view in views.items()
                                    if plan.is_local(index, rank)),
           "slots_untouched": all(bool((view[: len(block_ids)] == 1).all()) for index, view in views.items()
                                  if not plan.is_local(index, rank)),
           "slot_blocks": storage.slot_blocks, "model_runner": state.runner_kind}
    zeroer = getattr(runner, "kv_block_zeroer", None)
    try:
        control()
        out["vllm_own"] = None
    except Exception as exc:  # the control: pool ids on views of S blocks
        out["vllm_own"] = type(exc).__name__
    finally:
        if state.runner_kind == "V2":
            runner.kv_block_zeroer = zeroer
    return out


def v2_warm_up(worker) -> dict:
    """vLLM's V2 kernel warm-up as its GPU worker runs it (``gpu_worker.compile_or_warm_up_model`` calls
    ``gpu.warmup.warmup_kernels``, which schedules real requests on real block ids through the worker's
    ``execute_model``), here through the KVPP worker's own ``compile_or_warm_up_model`` with vLLM CPU's
    worker method standing in for the GPU worker's (vLLM's CPU worker never warms up this way). Returns the
    forwards it added on this rank, the largest block id its steps scheduled and the slot size: past a
    compact slot's end, so a non-owned layer in passthrough would index outside its slot."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu.warmup import warmup_kernels

    from kvpp_fx.integrations.vllm.engine.stats import worker_stats

    block_ids: list[int] = []

    def execute_model(scheduler_output):
        for request in scheduler_output.scheduled_new_reqs:
            block_ids.extend(i for group in request.block_ids for i in group)
        for group_ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            block_ids.extend(i for group in group_ids or () for i in group)
        return worker.execute_model(scheduler_output)

    def sample_tokens(grammar_output):
        # The warm-up's sampler features (an all-allowed grammar bitmask, top-k/top-p) run Triton kernels
        # that fail under the interpreter; here it samples greedily. They touch only logits, nothing KVPP reads.
        return worker.sample_tokens(None)

    def gpu_workers_warm_up(self):
        warmup_kernels(self.model_runner, execute_model, sample_tokens)

    worker = getattr(worker, "worker", worker)  # collective_rpc hands vLLM's WorkerWrapperBase
    before = worker_stats(worker)["forwards"]
    saved = CPUWorker.compile_or_warm_up_model, torch.accelerator.synchronize, SamplingParams.for_sampler_warmup
    CPUWorker.compile_or_warm_up_model, torch.accelerator.synchronize = gpu_workers_warm_up, lambda *a: None
    SamplingParams.for_sampler_warmup = staticmethod(lambda: SamplingParams(temperature=0))
    try:
        type(worker).compile_or_warm_up_model(worker)
    finally:
        CPUWorker.compile_or_warm_up_model, torch.accelerator.synchronize, for_sampler_warmup = saved
        SamplingParams.for_sampler_warmup = staticmethod(for_sampler_warmup)
    return {"forwards": worker_stats(worker)["forwards"] - before, "max_block_id": max(block_ids),
            "slot_blocks": worker.model_runner._kvpp.comm.runtime.storage.slot_blocks}


def vllm_num_blocks(worker) -> int:
    return int(worker.model_runner.kv_cache_config.num_blocks)


def kv_cache_bytes(worker) -> int:
    """The bytes behind the caches vLLM bound to the worker's attention layers, each backing storage once."""
    import torch

    storages = {}
    for layer in worker.model_runner.compilation_config.static_forward_context.values():
        caches = getattr(layer, "kv_cache", None)
        for cache in caches if isinstance(caches, (list, tuple)) else [caches]:
            if isinstance(cache, torch.Tensor) and cache.numel():
                storages[cache.untyped_storage().data_ptr()] = cache.untyped_storage().nbytes()
    return sum(storages.values())


def split(_: str = "") -> dict:
    """Rewrite a vLLM-style graph with the KVPP pass, then split it with vLLM's own split_graph, with the
    first prefetch where mode 3 puts it (at the first wait) and at graph entry (the control)."""
    import torch
    from vllm.compilation.backends import split_graph

    from kvpp_fx.backend import kvpp_backend
    from kvpp_fx.integrations.vllm.setup.compile_modes import KVPP_SPLITTING_OPS
    from kvpp_fx.ops import is_kvpp_op
    from kvpp_fx.schedule import LayerSchedule
    from kvpp_fx.runtime.runtime import KVPPRuntime
    from tests.passes import toy
    from tests.support.specs import TOY_SPECS

    plan = toy.toy_plan(4)
    storage = toy.allocate(plan)
    for i in range(4):
        toy.VLLM_STYLE_CACHES[f"model.layers.{i}.self_attn.attn"] = storage.typed_views(i)["kv"]
    ops = ["toy_vllm::unified_attention", *KVPP_SPLITTING_OPS]
    out = {"splitting_ops": ops}
    for first_prefetch in ("at_first_wait", "entry"):
        backend = kvpp_backend(LayerSchedule(target_layers=(0, 1, 2, 3)), mode="eager", first_prefetch=first_prefetch,
                               specs=TOY_SPECS)
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(backend(gm, example_inputs))
            return graphs[-1]

        torch._dynamo.reset()
        model = torch.compile(toy.ToyVLLMStyle(4), backend=capture, fullgraph=True)
        with KVPPRuntime.create(plan, storage) as runtime, runtime.forward(has_history=False):
            model(torch.randn(3, toy.HIDDEN))
        _, items = split_graph(graphs[-1], ops)
        pieces = []
        for item in items:
            kvpp = [n.name for n in item.graph.graph.nodes if n.op == "call_function" and is_kvpp_op(n.target)]
            inputs = sum(n.op == "placeholder" for n in item.graph.graph.nodes)
            pieces.append({"name": item.submod_name, "splitting": item.is_splitting_graph, "kvpp_ops": kvpp,
                           "inputs": inputs})
        out[first_prefetch] = pieces
    return out


def _counter(llm, name: str) -> int:
    """One of vLLM's counters, summed (log stats on)."""
    return sum(int(m.value) for m in llm.get_metrics() if m.name == name)


def graph_checks(_: str = "") -> dict:
    """`spec_ops` and `split`, in one interpreter."""
    return {"spec_ops": spec_ops(), "split": split()}


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    checks = {"plugin_off": plugin_off, "construct_many": construct_many, "graph_checks": graph_checks,
              "generate_many": generate_many, "pd_example": pd_example, "nixl_pair": nixl_pair,
              "mooncake_pairs": mooncake_pairs}
    if name in ("nixl_producer", "mooncake_producer"):
        {"nixl_producer": nixl_producer, "mooncake_producer": mooncake_producer}[name](*args)
        sys.exit(0)
    print("KVPP-CHECK " + json.dumps(checks[name](*args)))
