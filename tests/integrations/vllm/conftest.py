"""Fixtures of the vLLM tests that more than one module uses, at session scope: each runs once per
session. (The `cases_*.py` files' own pytest process loads this file too; nothing here imports vLLM.)"""

import pytest

from tests.integrations.vllm.engine_runs import ENV
from tests.integrations.vllm.tiny_model import (make_tiny_deepseek, make_tiny_deepseek_v4_config,
                                                make_tiny_deepseek_v32_config)


@pytest.fixture(scope="session", autouse=True)
def vllm_cache(tmp_path_factory):
    """vLLM's compile caches in the test's temp dir: every run compiles, nothing outside is touched."""
    ENV["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm_cache"))
    yield
    ENV.pop("VLLM_CACHE_ROOT")


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory):
    return make_tiny_deepseek(tmp_path_factory.mktemp("tiny_deepseek"))


@pytest.fixture(scope="session")
def tiny_deepseek_v4_config(tmp_path_factory):
    return make_tiny_deepseek_v4_config(tmp_path_factory.mktemp("tiny_deepseek_v4"))


@pytest.fixture(scope="session")
def tiny_deepseek_v32_config(tmp_path_factory):
    return make_tiny_deepseek_v32_config(tmp_path_factory.mktemp("tiny_deepseek_v32"))
