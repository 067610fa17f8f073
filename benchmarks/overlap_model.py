"""Transfer time hidden by the prefetch, measured through a model compiled with kvpp_backend.

Each layer of the model runs a compute stand-in that releases the CPU (a custom op that sleeps, as a
device kernel would let the host wait) and then the reference model's cache write and attention ops
on a large latent cache, which the KVPP pass rebinds. The model is compiled in PIECEWISE mode; the
runtime is run twice on 2 gloo ranks: overlapped (the normal prefetch) and serial (``overlap=False``:
each broadcast completes inside its prefetch). Transfer time is the sum of the broadcast spans of the
serial run.

    hidden = (serial - overlapped) / transfer

    python benchmarks/overlap_model.py [--layers 8] [--layer-mib 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from _common import summary, write_result

from kvpp_fx.backend import kvpp_backend
from kvpp_fx.cache.allocate import allocate_cache
from kvpp_fx.cache.placement import KVPPPlan
from kvpp_fx.cache.spec import ComponentSpec, LayerCacheSpec, ModelCacheSpec
from kvpp_fx.launch import run_ranks
from kvpp_fx.reference.ops import REFERENCE_SPECS
from kvpp_fx.runtime.runtime import KVPPRuntime
from kvpp_fx.runtime.timeline import Timeline
from kvpp_fx.topology import create_kvpp_process_groups, kvpp_groups

RANK, ROPE, HEADS, BLOCK = 240, 16, 2, 16  # latent width 256 fp32: 16 KiB per block


@torch.library.custom_op("kvpp_bench::device_compute", mutates_args=())
def device_compute(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """A stand-in for device work: the host thread waits without using a core."""
    time.sleep(seconds)
    return x.clone()


@device_compute.register_fake
def _(x, seconds):
    return torch.empty_like(x)


class Layer(nn.Module):
    def __init__(self, index: int, seconds: float) -> None:
        super().__init__()
        self.index, self.seconds = index, seconds

    def forward(self, q, cache, slot_mapping, block_table, seq_lens, query_lens):
        q = torch.ops.kvpp_bench.device_compute(q, self.seconds)
        kv = q[:, 0, :].contiguous()
        torch.ops.kvpp_ref.write_kv(cache, kv[:, :RANK], kv[:, RANK:], slot_mapping, self.index)
        out = torch.ops.kvpp_ref.mla_attention(q[..., :RANK], q[..., RANK:], cache, block_table, seq_lens,
                                               query_lens, 0.1, self.index)
        return torch.cat([out, q[..., RANK:]], dim=-1)


class Model(nn.Module):
    def __init__(self, layers: int, seconds: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i, seconds) for i in range(layers))

    def forward(self, q, caches, slot_mapping, block_table, seq_lens, query_lens):
        for layer, cache in zip(self.layers, caches):
            q = layer(q, cache, slot_mapping, block_table, seq_lens, query_lens)
        return q


def worker(rank, world, layers, layer_mib, repeats):
    blocks = layer_mib * 2**20 // (BLOCK * (RANK + ROPE) * 4)
    spec = ModelCacheSpec("bench", BLOCK, tuple(LayerCacheSpec(i, (ComponentSpec("kv", "float32", (RANK + ROPE,)),))
                                               for i in range(layers)))
    plan = KVPPPlan(spec, group_size=world)
    group = create_kvpp_process_groups(kvpp_groups(world, tp=world))
    storage = allocate_cache(plan, dist.get_rank(group), blocks)
    inputs = (torch.randn(1, HEADS, RANK + ROPE), [storage.handles(i)["kv"] for i in range(layers)],
              torch.tensor([5]), torch.arange(4, dtype=torch.int32)[None], torch.tensor([6]), torch.tensor([1]))

    def forward_time(runtime, model):
        dist.barrier()
        start = time.perf_counter()
        with runtime.forward(has_history=True):
            model(*inputs)
        return time.perf_counter() - start

    # measure one broadcast first, to size the compute stand-in to about one broadcast per layer
    probe = KVPPRuntime.create(plan, storage, group, overlap=False, timeline=Timeline(rank))
    model = torch.compile(Model(layers, 0.0), backend=kvpp_backend(plan, mode="piecewise", specs=REFERENCE_SPECS),
                          fullgraph=True)
    for _ in range(3):
        forward_time(probe, model)
    spans = [e["dur"] for e in probe.timeline.events if e["cat"] == "broadcast"]
    seconds = 1.2 * statistics.median(spans) / 1e6
    probe.close()
    torch._dynamo.reset()
    model = torch.compile(Model(layers, seconds), backend=kvpp_backend(plan, mode="piecewise", specs=REFERENCE_SPECS),
                          fullgraph=True)
    serial_rt = KVPPRuntime.create(plan, storage, group, overlap=False, timeline=Timeline(rank))
    overlap_rt = KVPPRuntime.create(plan, storage, group, overlap=True)
    forward_time(serial_rt, model), forward_time(overlap_rt, model)  # warm-up
    serial, overlapped, transfer = [], [], []
    for _ in range(repeats):
        before = len(serial_rt.timeline.events)
        serial.append(forward_time(serial_rt, model))
        transfer.append(sum(e["dur"] for e in serial_rt.timeline.events[before:] if e["cat"] == "broadcast") / 1e6)
        overlapped.append(forward_time(overlap_rt, model))
    serial_rt.close(), overlap_rt.close()
    return {"serial": serial, "overlapped": overlapped, "transfer": transfer, "compute_per_layer_s": seconds,
            "layer_bytes": blocks * BLOCK * (RANK + ROPE) * 4}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--layer-mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    res = run_ranks(worker, 2, args.layers, args.layer_mib, args.repeats, timeout_s=600)[0]
    med = {k: statistics.median(res[k]) for k in ("serial", "overlapped", "transfer")}
    hidden = (med["serial"] - med["overlapped"]) / med["transfer"]
    print(f"compiled model, {args.layers} layers of {args.layer_mib} MiB, "
          f"compute {res['compute_per_layer_s']*1e3:.1f} ms/layer")
    print(f"serial {med['serial']*1e3:.1f} ms  overlapped {med['overlapped']*1e3:.1f} ms  "
          f"transfer {med['transfer']*1e3:.1f} ms  -> hidden fraction {hidden:.3f}")
    write_result("overlap_model", {"layers": args.layers, "layer_bytes": res["layer_bytes"],
                                   "compute_per_layer_ms": res["compute_per_layer_s"] * 1e3,
                                   "seconds": {k: summary(res[k]) for k in ("serial", "overlapped", "transfer")},
                                   "hidden_fraction": hidden, "goal": 0.95}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
