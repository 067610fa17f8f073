"""KVPP on the prefill instance of a prefill/decode pair: its prefix cache and TTFT, KVPP off against on.

    python benchmarks/pd_prefill.py [--layers 16] [--kv-memory 48MiB] [--prefixes 8] [--prefix-len 512]
        [--requests 32] [--connectors NixlConnector,MooncakeConnector]

The seed's own measure. A tiny random DeepSeek-V3 (``--layers``) runs as a TP 2 prefill instance as a PD
deployment configures it (``kv_role`` "kv_producer"; vLLM's NixlConnector over UCX on loopback, and
vLLM's MooncakeConnector over TCP on loopback), with the same ``kv_cache_memory_bytes``, KVPP off and
then on, for each connector. The workload is what prefix caching is
for: ``--prefixes`` shared prefixes of ``--prefix-len`` tokens, each of ``--requests`` requests one of
them (drawn at random, the same sequence for both) plus a short suffix of its own, one request at a
time, one output token each (a prefill node's work). Reported, off and on: the KV capacity in tokens, vLLM's prefix
cache
hit rate (``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``) and the time to first token,
per request (on 2 cores, NIXL's own CPU use slows every step of its engines, and the TTFT ratio moved
between runs: 0.52x and 0.85x with NIXL, 1.85x and 1.38x with Mooncake, the order of the runs swapped;
the capacity and the hit rates did not). No decode instance reads the KV here: what KVPP changes on a prefill node is
how many
prefixes its cache keeps, and that is measured alone.

The engines run vLLM's default model runner (V2, its Triton kernels under Triton's interpreter), eagerly
in bfloat16 on the platform's MLA backend. vLLM CPU caches prefixes for MLA only on AMX_MLA (CPUs with
AMX); elsewhere the tests' shim `tests/integrations/vllm/cpu_chunked_prefill.py` keeps prefix caching (and
chunked prefill) on, as on CUDA.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from _common import summary, write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tests.integrations.vllm.triton_interpreter  # noqa: E402, F401  (before vLLM: V2's Triton kernels, interpreted)
from tests.integrations.vllm import cpu_chunked_prefill, mooncake_on_cpu  # noqa: E402
from kvpp_fx.cli.byte_sizes import parse_bytes  # noqa: E402
from tests.integrations.vllm.tiny_model import make_tiny_deepseek  # noqa: E402


def _counter(llm, name: str) -> float:
    return sum(float(m.value) for m in llm.get_metrics() if m.name == name)


TRANSFERS = {
    "NixlConnector": {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"},
    "MooncakeConnector": {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"mooncake_protocol": "tcp"}},
}


def run(model: str, connector: str, kvpp: bool, args: argparse.Namespace, port: int) -> dict:
    from vllm import LLM, SamplingParams

    os.environ.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(port),
                      VLLM_MOONCAKE_BOOTSTRAP_PORT=str(port), VLLM_HOST_IP="127.0.0.1")
    llm = LLM(model=model, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="bfloat16", enforce_eager=True,
              kv_cache_memory_bytes=args.kv_memory, max_model_len=args.prefix_len + 64, disable_log_stats=False,
              enable_prefix_caching=True, additional_config={"enable_kvpp": kvpp},
              kv_transfer_config=dict(TRANSFERS[connector]))
    try:
        config = llm.llm_engine.vllm_config
        prefixes = [[(31 * p + 7 * i + 3) % 500 for i in range(args.prefix_len)] for p in range(args.prefixes)]
        params = SamplingParams(max_tokens=1, temperature=0)
        hits, queries = (_counter(llm, "vllm:prefix_cache_hits"), _counter(llm, "vllm:prefix_cache_queries"))
        draws = random.Random(0)
        ttft = []
        for r in range(args.requests):
            prefix = prefixes[draws.randrange(args.prefixes)]
            suffix = [(11 * r + 5 * i + 1) % 500 for i in range(args.suffix_len)]
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prefix + suffix}], params, use_tqdm=False)
            ttft.append(time.perf_counter() - start)
        hits = _counter(llm, "vllm:prefix_cache_hits") - hits
        queries = _counter(llm, "vllm:prefix_cache_queries") - queries
        blocks = config.cache_config.num_gpu_blocks
        backends = None
        if kvpp:
            from kvpp_fx.integrations.vllm.engine.stats import worker_stats

            backends = llm.collective_rpc(worker_stats)[0]["attention_backends"]
        return {"kvpp": kvpp, "attention_backends": backends,
                "prefix_caching": bool(config.cache_config.enable_prefix_caching),
                "block_size": config.cache_config.block_size, "num_blocks": blocks,
                "capacity_tokens": blocks * config.cache_config.block_size,
                "connector_module": config.kv_transfer_config.kv_connector_module_path,
                "prefix_cache_hits": hits, "prefix_cache_queries": queries,
                "hit_rate": hits / queries if queries else 0.0,
                # the first requests fill the cache; the rest is what a warm prefill node serves
                "ttft_s": summary(ttft), "ttft_warm_s": summary(ttft[args.prefixes:])}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--kv-memory", default="48MiB")
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--connectors", default=",".join(TRANSFERS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.kv_memory = parse_bytes(args.kv_memory)
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING",
                      **{cpu_chunked_prefill.ENV: "1", mooncake_on_cpu.ENV: "1"})
    cpu_chunked_prefill.apply()
    mooncake_on_cpu.apply()
    result = {"layers": args.layers, "tp": 2, "kv_memory_bytes": args.kv_memory, "prefixes": args.prefixes,
              "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "requests": args.requests,
              "dtype": "bfloat16", "connectors": {}}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["VLLM_CACHE_ROOT"] = str(Path(tmp) / "vllm_cache")
        model = make_tiny_deepseek(Path(tmp) / "model", num_layers=args.layers,
                                   max_positions=args.prefix_len + 64)
        for k, connector in enumerate(args.connectors.split(",")):
            off = run(model, connector, False, args, 25801 + 4 * k)
            on = run(model, connector, True, args, 25803 + 4 * k)
            result["connectors"][connector] = {
                "off": off, "on": on, "capacity_ratio": on["capacity_tokens"] / off["capacity_tokens"],
                "ttft_warm_ratio": on["ttft_warm_s"]["median"] / off["ttft_warm_s"]["median"]}
            for name, r in (("off", off), ("on", on)):
                print(f"{connector} {name}: {r['capacity_tokens']} tokens, hit rate {r['hit_rate']:.3f}, "
                      f"warm TTFT median {r['ttft_warm_s']['median'] * 1000:.0f} ms")
    write_result("pd_prefill", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
