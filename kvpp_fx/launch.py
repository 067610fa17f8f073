"""Run a function on N local ranks: real processes, gloo on 127.0.0.1, always with a timeout.

Used by the tests and by `kvpp_fx.reference.generate`. Each rank runs ``fn(rank, world_size, *args)``
after ``init_process_group``; its return value (or its traceback) comes back to the caller. A rank
that hangs or dies is reported by rank, never waited on forever. Ranks start from multiprocessing's fork
server with torch already imported, and each gets the caller's environment as it is at the call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Ranks fork from a server process that imported these once, instead of each importing them anew (about
# 4 s a rank on 2 cores, most of it torch._dynamo). The server imports nothing else and runs nothing.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "kvpp_fx.runtime.runtime",
                      "kvpp_fx.reference.generate")


def _rank_context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def _rank_entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, pg_timeout_s: float,
                args: tuple, env: dict[str, str], results: Any) -> None:
    # The fork server's environment is the caller's when it started; each rank gets the caller's now.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=pg_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              pg_timeout_s: float = 30.0, env: dict[str, str] | None = None,
              may_die: Iterable[int] = ()) -> list[Any]:
    """Run `fn` on `world_size` new rank processes and return their results, indexed by rank.

    `fn` must be importable (a module-level function). Ranks in `may_die` are allowed to exit without
    a result (their entry is None). Anything else that fails raises `RankFailure` naming the ranks.
    """
    import torch.distributed as dist

    ctx = _rank_context()
    results = ctx.Queue()
    # The caller holds the rendezvous store, bound before any rank starts: no port is picked, released
    # and bound again later, when another socket (gloo's own among them) may have taken it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=pg_timeout_s))
    port = store.port
    env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
    procs = [ctx.Process(target=_rank_entry, name=f"kvpp-rank{rank}",
                         args=(fn, rank, world_size, port, pg_timeout_s, args, env, results), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    outputs: dict[int, tuple[bool, Any]] = {}
    may_die = set(may_die)
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.5)
                outputs[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            if all(not procs[r].is_alive() for r in range(world_size) if r not in outputs):
                while True:  # every silent rank has exited: collect what they queued, then stop
                    try:
                        rank, ok, value = results.get(timeout=1.0)
                        outputs[rank] = (ok, value)
                    except queue.Empty:
                        break
                break
    finally:
        timed_out = len(outputs) < world_size and time.monotonic() >= deadline
        for proc in procs:
            proc.join(timeout=2.0)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        del store
    failures = []
    for rank in range(world_size):
        if rank not in outputs:
            if rank in may_die:
                continue
            code = procs[rank].exitcode
            if code is None or code == -9 and timed_out:
                failures.append(f"rank {rank}: no result within {timeout_s:.0f}s (killed)")
            else:
                failures.append(f"rank {rank}: exited with code {code} without a result")
        elif not outputs[rank][0]:
            failures.append(f"rank {rank} raised:\n{outputs[rank][1]}")
    if failures:
        raise RankFailure("\n".join(failures))
    return [outputs[r][1] if r in outputs else None for r in range(world_size)]
