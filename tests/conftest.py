import os
import tempfile

import pytest
from hypothesis import settings

# Property tests check properties, not speed: on a loaded 2-core host an example can take a second.
settings.register_profile("kvpp", deadline=None)
settings.load_profile("kvpp")

# Inductor's cache lives in the test tree's temp dir, never in the user's home or /tmp/torchinductor_*.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="kvpp-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    import torch._dynamo

    torch._dynamo.reset()


def pytest_terminal_summary(terminalreporter):
    """Which MLA backend vLLM CPU ran on this host: the vLLM checks cover the host's own kind only."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        kind = "AMX_MLA (this host has AMX: bfloat16, block 128, chunked prefill and prefix caching)"
    else:
        kind = ("CPU_MLA (this host has no AMX: block 16; vLLM CPU turns chunked prefill and prefix caching off for "
                "MLA, and the checks of both restore them with tests/integrations/vllm/cpu_chunked_prefill.py)")
    if os.environ.get("KVPP_TESTS_HIDE_AMX") == "1":
        kind += " [AMX hidden by KVPP_TESTS_HIDE_AMX]"
    terminalreporter.write_line(f"vLLM CPU's own MLA backend here: {kind}")
