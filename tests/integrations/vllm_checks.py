"""Checks that need vLLM, run as `python -m tests.integrations.vllm_checks NAME ARGS`: vLLM's import has
process-wide side effects, so the tests run each check in a fresh interpreter and read its JSON."""

from __future__ import annotations

import json
import os
import sys


def construct(model_dir: str, extra_json: str) -> dict:
    """Build an LLM's engine config with the given arguments; report the error, if any."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.engine.arg_utils import EngineArgs

    extra = json.loads(extra_json)
    try:
        config = EngineArgs(model=model_dir, skip_tokenizer_init=True, **extra).create_engine_config()
    except Exception as exc:  # the test compares the message
        return {"error": type(exc).__name__, "message": str(exc), "is_value_error": isinstance(exc, ValueError)}
    return {"error": None, "additional_config": dict(config.additional_config),
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode)}


def generate(model_dir: str, kvpp: str, extra_json: str = "{}") -> dict:
    """Greedy tokens from LLM(...) at TP 2, and what each worker's KVPP runtime saw."""
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      VLLM_USE_AOT_COMPILE="0")
    from vllm import LLM, SamplingParams

    from kvpp_fx.integrations.vllm.worker import worker_stats

    args = dict(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=2, enforce_eager=True,
                kv_cache_memory_bytes=32 << 20, compilation_config={"custom_ops": ["-rotary_embedding"]},
                additional_config={"enable_kvpp": kvpp == "on"})
    args.update(json.loads(extra_json))
    llm = LLM(**args)
    prompts = [[(7 * i + 3) % 500 for i in range(90)], [(5 * i + 1) % 500 for i in range(70)]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0))
    stats = llm.collective_rpc(worker_stats)
    blocks = llm.collective_rpc(vllm_num_blocks)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "stats": stats, "num_blocks": blocks}


def vllm_num_blocks(worker) -> int:
    return int(worker.model_runner.kv_cache_config.num_blocks)


def split(_: str = "") -> dict:
    """Rewrite a vLLM-style graph with the KVPP pass, then split it with vLLM's own split_graph."""
    import torch
    from vllm.compilation.backends import split_graph

    from kvpp_fx.backend import kvpp_backend
    from kvpp_fx.integrations.vllm.compilation import splitting_ops
    from kvpp_fx.ops import is_kvpp_op
    from kvpp_fx.passes.layer_table import LayerTable
    from kvpp_fx.runtime.runtime import KVPPRuntime
    from tests.passes import toy

    backend = kvpp_backend(LayerTable(target_layers=(0, 1, 2, 3)), mode="eager")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(backend(gm, example_inputs))
        return graphs[-1]

    plan = toy.toy_plan(4)
    storage = toy.allocate(plan)
    for i in range(4):
        toy.VLLM_STYLE_CACHES[f"model.layers.{i}.self_attn.attn"] = storage.typed_views(i)["kv"]
    model = torch.compile(toy.ToyVLLMStyle(4), backend=capture, fullgraph=True)
    with KVPPRuntime.create(plan, storage) as runtime, runtime.forward(has_history=False):
        model(torch.randn(3, toy.HIDDEN))
    ops = splitting_ops(["toy_vllm::unified_attention"])
    _, items = split_graph(graphs[-1], ops)
    pieces = []
    for item in items:
        kvpp = [n.name for n in item.graph.graph.nodes if n.op == "call_function" and is_kvpp_op(n.target)]
        pieces.append({"name": item.submod_name, "splitting": item.is_splitting_graph, "kvpp_ops": kvpp})
    return {"splitting_ops": ops, "pieces": pieces}


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    checks = {"construct": construct, "split": split, "generate": generate}
    print("KVPP-CHECK " + json.dumps(checks[name](*args)))
