"""The CUDA path in one prepared run: device ordering, end to end, overlap and host time on a real GPU.

    make device-check                        # CUDA when torch sees a GPU, else a smoke pass on CPU
    python -m benchmarks.device_check [--out PATH] [--wheels .device-wheels] [--budget-s 480] [--only NAMES]
                                      [--cpu] [--inner BACKEND]

The package: `preflight` (the interpreter and its torch), `seams` (device helpers and the fault seam), `checks`
(the ranks' work: ordering, overlap and host time, end to end), `report` (run, judge, print, write).

Two ranks run on one GPU (``cuda:0``) over gloo with CUDA tensors (NCCL refuses two ranks on one
device), with real streams and events. The checks (docs/device-check.md says what they prove and what
they do not):

- ``ordering``: the runtime driven as a rewritten graph drives it, with the compute stream stalled
  (``torch.cuda._sleep``) before every ready point (the owner's write into its persistent view, then
  ``prefetch``), every done point (``wait``) and every attention read. Every byte attention reads, read
  on the compute stream, must be the owner's: whole layers, active blocks, a link whose bytes land late,
  and owner mode's exchanges. Negative controls drop one wait through a `DeviceAPI` seam (the transfer
  stream's wait on ``ready``, the compute stream's wait on ``done``, ``Work.wait()`` of the exchanges)
  and must be caught.
- ``end_to_end``: the reference engine at TP 2 on the device, PIECEWISE with inductor, KVPP in
  broadcast, owner and auto mode with active blocks: greedy tokens identical to KVPP off.
- ``overlap``: the fraction of the transfer hidden behind real GPU compute (matmuls).
- ``host_time``: the runtime's host time per layer with CUDA streams (the CPU benchmark's no-op
  transport), beside the CPU figure, and the CUDA synchronisations the runtime makes per layer.
- ``owner_kernels``: owner calls on vLLM's TRITON_MLA and FlashMLA kernels, where vLLM is installed.
- ``breakable_capture``: a breakable CUDA-graph capture (real graph segments) of a layer whose MLA cache
  write KVPP records as an eager break: replayed steps write through their own slot mappings; the
  control, the write inside the graph, replays the capture's (`capture`).

Every check prints one line, ``device-check <name>: PASS|FAIL|SKIP <figure or reason>``, and the JSON
goes to ``benchmarks/results/device_check.json`` on a GPU, or to a temporary file on the CPU smoke pass
(which never overwrites a GPU result). On a GPU the exit code is 1 when a check fails. Without a GPU
the same code runs on CPU, where streams and events do nothing: the smoke pass says what it could not
run and exits 0 unless a check fails.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path

# The device machine's torch may lack numpy, which it only needs for what this check does not do; every
# spawned rank would warn about it at import.
os.environ.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # the working tree's kvpp_fx, whatever is installed
    sys.path.insert(1, str(ROOT))
if str(HERE) not in sys.path:  # the other benchmarks' modules (runtime_overhead), as when run from benchmarks/
    sys.path.insert(2, str(HERE))


GPU_RESULT = HERE / "results" / "device_check.json"
SMOKE_RESULT = Path(tempfile.gettempdir()) / "kvpp-device-check-smoke.json"
CPU_OVERHEAD = HERE / "results" / "runtime_overhead.json"
CHECKS = ("ordering", "overlap", "host_time", "end_to_end", "owner_kernels", "breakable_capture")
WORLD = 2
STALL_MS = 5.0  # far above a small gloo transfer (~0.1-0.3 ms), so an unordered access shows every time
LATE_MS = 20.0  # how late a slow link's bytes land: far above a compute step that does not wait for them
OVERLAP_GOAL = 0.90
# `dist.new_group` without a timeout gets torch's 30 minutes, not the world's: every group here names its own
MEASURE_GROUP_TIMEOUT = timedelta(seconds=60)
E2E_GROUP_TIMEOUT = timedelta(seconds=120)  # below the world's 180 s, so a stuck peer times out before the barrier
REQUIRED_MODULES = ("pydantic",)  # what kvpp_fx imports beyond torch (integrations/vllm/setup/config.py)

