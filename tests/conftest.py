import os
import tempfile

import pytest

# Inductor's cache lives in the test tree's temp dir, never in the user's home or /tmp/torchinductor_*.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="kvpp-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    import torch._dynamo

    torch._dynamo.reset()
