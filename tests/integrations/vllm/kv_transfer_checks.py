"""The prefill/decode checks of `vllm_checks` (ExampleConnector, NixlConnector, MooncakeConnector) and the
worker functions they run over ``collective_rpc``: run through `vllm_checks`, the entry module (``python -m
tests.integrations.vllm.vllm_checks pd_example ...``), which imports what must come before vLLM; a
producer's own process runs it again (``nixl_producer``, ``mooncake_producer``)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys

from tests.integrations.vllm import mooncake_on_cpu


def _external_hits(llm) -> int:
    """The prompt tokens this engine loaded through its KV connector (vLLM's counter, log stats on)."""
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")


def pd_example(model_dir: str, spec_json: str) -> dict:
    """Prefill/decode pairs over vLLM's ExampleConnector (disk), one engine after another here.

    ``spec``: ``storage`` (a directory), ``prompts`` (token ids), ``producers`` (name -> LLM arguments of
    a TP 2 ``kv_producer`` that writes ``storage/<name>``; ``kv_connector_module_path`` among them goes to
    its kv_transfer_config), ``consumer`` (LLM arguments of the ``kv_consumer``). Each producer prefills
    the prompts (one token each); then one consumer engine decodes them once per producer, its storage
    holding that producer's files. Returns, per producer, its worker stats, its connector module, the
    name -> digest of every file it wrote, and its tokens when it runs the prompts again, loading them from
    its own files (or the error), and per producer the consumer's tokens and how
    many prompt tokens it loaded (vLLM's ``vllm:external_prefix_cache_hits``).
    """
    import hashlib
    import shutil
    import traceback
    from pathlib import Path

    from safetensors.torch import load_file

    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0")
    from vllm import LLM, SamplingParams

    from kvpp_fx.integrations.vllm.engine.stats import worker_stats

    spec = json.loads(spec_json)
    root = Path(spec["storage"])
    requests = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def transfer(role: str, storage: Path) -> dict:
        return {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}

    def digests(storage: Path) -> dict:
        return {str(f.relative_to(storage)): hashlib.sha256(load_file(f)["kv_cache"].numpy().tobytes()).hexdigest()
                for f in sorted(storage.rglob("*.safetensors"))}

    result = {"producers": {}, "consumer": {}}
    for name, args in spec["producers"].items():
        storage = root / name
        storage.mkdir(parents=True)
        args = dict(args)
        connector = transfer("kv_producer", storage)
        if "kv_connector_module_path" in args:
            connector["kv_connector_module_path"] = args.pop("kv_connector_module_path")
        try:
            llm = LLM(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=2, disable_log_stats=False,
                      kv_transfer_config=connector, **args)
            try:
                llm.generate(requests, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
                # Again: the producer now finds the prompts on disk and loads them (no prefix cache here).
                before = _external_hits(llm)
                again = llm.generate(requests, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                     use_tqdm=False)
                reloaded = {"tokens": [list(o.outputs[0].token_ids) for o in again],
                            "external_hits": _external_hits(llm) - before}
                kvpp = args.get("additional_config", {}).get("enable_kvpp")
                stats = llm.collective_rpc(worker_stats) if kvpp else None
                module = llm.llm_engine.vllm_config.kv_transfer_config.kv_connector_module_path
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
            result["producers"][name] = {"files": digests(storage), "stats": stats, "connector_module": module,
                                         "reloaded": reloaded}
        except Exception:  # reported to the test that reads this producer
            result["producers"][name] = {"error": traceback.format_exc()}

    loaded = root / "consumer"

    llm = LLM(model=model_dir, skip_tokenizer_init=True, kv_transfer_config=transfer("kv_consumer", loaded),
              disable_log_stats=False, **spec["consumer"])
    try:
        for name, produced in result["producers"].items():
            if "error" in produced:
                continue
            shutil.rmtree(loaded, ignore_errors=True)
            shutil.copytree(root / name, loaded)
            before = _external_hits(llm)
            outputs = llm.generate(requests, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                   use_tqdm=False)
            result["consumer"][name] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                                        "external_hits": _external_hits(llm) - before}
    finally:
        llm.llm_engine.engine_core.shutdown()
    return result


def _connector_errors() -> list[str]:
    """The messages of the errors vLLM's KV connectors log in this process from now on. (On vLLM's own
    logger, once an engine is up: vLLM's logging set-up disables loggers made before it.)"""
    import logging

    errors: list[str] = []

    class ConnectorErrors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if ".kv_connector." in record.name:
                errors.append(record.getMessage() + (f" {record.exc_info[1]}" if record.exc_info else ""))

    logging.getLogger("vllm").addHandler(ConnectorErrors(logging.ERROR))
    return errors


def _nixl_env(port: int) -> dict:
    """NIXL over UCX on loopback: each instance's side channel on its own port."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
            "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _nixl_transfer(role: str, module: str | None) -> dict:
    transfer = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    if module:
        transfer["kv_connector_module_path"] = module
    return transfer


def nixl_producer(model_dir: str, spec_json: str) -> None:
    """The prefill instance of `nixl_pair`, in a process of its own: prefills the prompts (one token
    each, ``do_remote_decode``), prints their kv_transfer_params, then serves the reads until a line
    arrives on stdin."""
    spec = json.loads(spec_json)
    os.environ.update(_nixl_env(spec["port"]))
    from vllm import LLM, SamplingParams

    from kvpp_fx.integrations.vllm.engine.stats import worker_stats

    args = dict(spec["args"])
    llm = LLM(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=2,
              kv_transfer_config=_nixl_transfer("kv_producer", args.pop("kv_connector_module_path", None)), **args)
    try:
        params = SamplingParams(max_tokens=1, temperature=0,
                                extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
        kvpp = args.get("additional_config", {}).get("enable_kvpp")
        print("KVPP-PRODUCED " + json.dumps({
            "kv_transfer_params": [o.kv_transfer_params for o in outputs],
            "connector_module": llm.llm_engine.vllm_config.kv_transfer_config.kv_connector_module_path,
            "stats": llm.collective_rpc(worker_stats) if kvpp else None}), flush=True)
        sys.stdin.readline()
    finally:
        llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _producer(check: str, model_dir: str, spec: dict):
    """A prefill instance (`nixl_producer` or `mooncake_producer`) in a process of its own: yields its
    report once its prefills are done, and tells it to stop on the way out."""
    import subprocess
    import threading

    producer = subprocess.Popen([sys.executable, "-m", "tests.integrations.vllm.vllm_checks", check, model_dir,
                                 json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("KVPP-PRODUCED "):
            line = producer.stdout.readline()
            if not line:
                raise RuntimeError(f"the producer exited ({producer.wait()}) before its prefills were done")
        # vLLM logs to stdout: a pipe nobody reads would stall the producer once full.
        threading.Thread(target=producer.stdout.read, daemon=True).start()
        yield json.loads(line.removeprefix("KVPP-PRODUCED "))
    finally:
        if producer.poll() is None:
            producer.stdin.write("done\n")
            producer.stdin.flush()
            try:
                producer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                producer.kill()


def kv_digests(worker) -> dict:
    """name -> sha256 of each attention layer's whole KV cache in this worker."""
    import hashlib

    import torch

    layers = worker.model_runner.compilation_config.static_forward_context
    return {name: hashlib.sha256(layer.kv_cache.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, layer in sorted(layers.items()) if getattr(layer, "kv_cache", None) is not None}


def nixl_pair(model_dir: str, spec_json: str) -> dict:
    """A prefill/decode pair over vLLM's NixlConnector (UCX on loopback): the producer (`nixl_producer`,
    TP 2, ``spec["producer"]`` its LLM arguments) in a process of its own, the decode instance (TP 1,
    ``spec["decode"]``) here. Returns the decode instance's tokens, the prompt tokens it loaded (vLLM's
    ``vllm:external_prefix_cache_hits``), a digest of each of its layers' cache afterwards, the connector
    errors it logged, and the producer's report; or the decode's error (``error``: its type and message) and
    the producer's report."""
    import traceback

    spec = json.loads(spec_json)
    producer_spec = {"port": spec["ports"][0], "args": spec["producer"], "prompts": spec["prompts"]}
    with _producer("nixl_producer", model_dir, producer_spec) as produced:
        os.environ.update(_nixl_env(spec["ports"][1]))
        from vllm import LLM, SamplingParams

        args = dict(spec["decode"])
        llm = LLM(model=model_dir, skip_tokenizer_init=True, disable_log_stats=False,
                  kv_transfer_config=_nixl_transfer("kv_consumer", args.pop("kv_connector_module_path", None)),
                  **args)
        errors = _connector_errors()
        try:
            requests = [(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                extra_args={"kv_transfer_params": params}))
                        for prompt, params in zip(spec["prompts"], produced["kv_transfer_params"])]
            try:
                # One request at a time: when each request's KV arrives decides which requests a decode step
                # batches, and the batch changes vLLM's numerics (the rows the decode writes).
                outputs = [llm.generate([{"prompt_token_ids": p}], s, use_tqdm=False)[0] for p, s in requests]
            except Exception as exc:  # the test reads which error, by name
                return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                        "producer": produced}
            return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "external_hits": _external_hits(llm),
                    "kv": llm.collective_rpc(kv_digests)[0], "producer": produced, "errors": errors}
        finally:
            llm.llm_engine.engine_core.shutdown()


def _mooncake_env(bootstrap_port: int) -> dict:
    """vLLM's MooncakeConnector over TCP on loopback, on CPU (`mooncake_on_cpu`); the prefill instance's
    bootstrap server on its own port."""
    return {**_nixl_env(0), "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port), mooncake_on_cpu.ENV: "1"}


def _mooncake_transfer(role: str, module: str | None, engine_id: str | None = None) -> dict:
    transfer = {"kv_connector": "MooncakeConnector", "kv_role": role,
                "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    if engine_id:
        transfer["engine_id"] = engine_id
    if module:
        transfer["kv_connector_module_path"] = module
    return transfer


def mooncake_producer(model_dir: str, spec_json: str) -> None:
    """A prefill instance of `mooncake_pairs`, in a process of its own: prefills the prompts (one token
    each, ``do_remote_decode`` with the router's transfer ids), says so, then serves the decode instance's
    requests for their KV until a line arrives on stdin."""
    import select

    spec = json.loads(spec_json)
    os.environ.update(_mooncake_env(spec["port"]))
    mooncake_on_cpu.apply()
    from vllm import LLM, SamplingParams

    from kvpp_fx.integrations.vllm.engine.stats import worker_stats

    args = dict(spec["args"])
    llm = LLM(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=2,
              kv_transfer_config=_mooncake_transfer("kv_producer", args.pop("kv_connector_module_path", None),
                                                    spec["engine_id"]), **args)
    try:
        requests = [({"prompt_token_ids": p}, SamplingParams(max_tokens=1, temperature=0, extra_args={
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"{spec['engine_id']}-{i}"}}))
            for i, p in enumerate(spec["prompts"])]
        llm.generate([r for r, _ in requests], [s for _, s in requests], use_tqdm=False)
        kvpp = args.get("additional_config", {}).get("enable_kvpp")
        print("KVPP-PRODUCED " + json.dumps({
            "connector_module": llm.llm_engine.vllm_config.kv_transfer_config.kv_connector_module_path,
            "stats": llm.collective_rpc(worker_stats) if kvpp else None}), flush=True)
        # A finished request's blocks reach the workers' senders in the engine's next step, as a server's
        # engine loop runs it; until then a decode rank's request for them waits.
        while not select.select([sys.stdin], [], [], 0.05)[0]:
            llm.llm_engine.step()
    finally:
        llm.llm_engine.engine_core.shutdown()


def kv_row_digests(worker, block_ids: list[int]) -> dict:
    """name -> one request's rows of the layer's KV cache, by position: ``rows``, for each of the request's
    blocks in the order of its block table (`_block_tables`) each row's digest (16 hex digits; None for a
    row of zeros), so that row ``p`` is token ``p``'s; ``stray``, the non-zero rows outside those blocks."""
    import hashlib

    import torch

    layers = worker.model_runner.compilation_config.static_forward_context
    ids = torch.as_tensor(block_ids, dtype=torch.long)
    out = {}
    for name, layer in sorted(layers.items()):
        cache = getattr(layer, "kv_cache", None)
        if cache is None:
            continue
        rows = cache[ids].reshape(-1, cache.shape[-1])  # [blocks, block_size, 576]: row p of the request
        outside = torch.ones(cache.shape[0], dtype=torch.bool)
        outside[ids] = False
        out[name] = {"rows": [hashlib.sha256(row.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
                              if bool(row.any()) else None for row in rows],
                     "stray": int(cache[outside].reshape(-1, cache.shape[-1]).any(dim=-1).sum())}
    return out


def _block_tables(llm) -> list[list[int]]:
    """The block table of every request this engine finishes from now on, in order, read from vLLM's
    scheduler (in this interpreter: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) as it frees the request."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    tables: list[list[int]] = []
    free = scheduler._free_request

    def recording_free(request, *args, **kwargs):
        tables.append([int(i) for i in scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]])
        return free(request, *args, **kwargs)

    scheduler._free_request = recording_free
    return tables


def zero_kv(worker) -> None:
    layers = worker.model_runner.compilation_config.static_forward_context
    for layer in layers.values():
        if getattr(layer, "kv_cache", None) is not None:
            layer.kv_cache.zero_()


def mooncake_pairs(model_dir: str, spec_json: str) -> dict:
    """Prefill/decode pairs over vLLM's MooncakeConnector (TCP on loopback): one decode instance (KVPP
    off; ``spec["decode"]`` its LLM arguments) here, and in turn each prefill
    instance of ``spec["producers"]`` (TP 2, `mooncake_producer`) in a process of its own. Per prefill
    instance: the decode's tokens (one request at a time), the prompt tokens it loaded (vLLM's
    ``vllm:external_prefix_cache_hits``), per request `kv_row_digests` of its ranks' caches once it is done,
    by position in its block table (the cache is zeroed and the prefix cache reset after each), the
    connector errors it logged, and the producer's report."""
    spec = json.loads(spec_json)
    os.environ.update(_mooncake_env(0))
    mooncake_on_cpu.apply()
    from vllm import LLM, SamplingParams

    args = dict(spec["decode"])
    llm = LLM(model=model_dir, skip_tokenizer_init=True, disable_log_stats=False,
              kv_transfer_config=_mooncake_transfer("kv_consumer", args.pop("kv_connector_module_path", None)),
              **args)
    errors = _connector_errors()
    tables = _block_tables(llm)
    results = {}
    try:
        for k, (name, producer_args) in enumerate(spec["producers"].items()):
            engine_id, port = f"prefill-{name}", spec["ports"][k]
            producer_spec = {"port": port, "args": producer_args, "prompts": spec["prompts"], "engine_id": engine_id}
            with _producer("mooncake_producer", model_dir, producer_spec) as produced:
                hits_before, errors_before = _external_hits(llm), len(errors)
                outputs, rows = [], []
                for i, prompt in enumerate(spec["prompts"]):
                    # One request at a time: when each request's KV arrives decides which requests a decode
                    # step batches, and the batch changes vLLM's numerics (the rows the decode writes).
                    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, extra_args={
                        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": engine_id,
                                               "remote_bootstrap_addr": f"http://127.0.0.1:{port}",
                                               "transfer_id": f"{engine_id}-{i}"}})
                    del tables[:]
                    outputs.append(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0])
                    rows.append(llm.collective_rpc(kv_row_digests, args=(tables[-1] if tables else [],)))
                    llm.reset_prefix_cache()
                    llm.collective_rpc(zero_kv)
                results[name] = {
                    "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                    "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
                    "external_hits": _external_hits(llm) - hits_before, "errors": errors[errors_before:],
                    "kv": rows, "producer": produced}
    finally:
        llm.llm_engine.engine_core.shutdown()
    return results
