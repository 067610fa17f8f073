"""The test tree. With ``KVPP_TESTS_HIDE_AMX=1`` in the environment, every process that imports it (the
test session, the vLLM check subprocesses and their spawned TP workers, which re-import their entry module)
sees a CPU without AMX: vLLM CPU then picks what it picks on such a host (CPU_MLA, block 16, chunked
prefill and prefix caching off for MLA, its non-AMX kernels), so an AMX host runs the no-AMX branches
(``make test-without-amx``)."""

import os

if os.environ.get("KVPP_TESTS_HIDE_AMX") == "1":
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
