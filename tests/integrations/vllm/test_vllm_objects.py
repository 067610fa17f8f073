"""KVPP's specs, validation, hooks and step host work against vLLM's real classes, without an engine: the
`cases_*.py` files, run in one pytest process of their own (vLLM's import changes process-wide state),
each case one result here.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.vllm.engine_runs import ENV, ROOT

pytestmark = pytest.mark.vllm


CASE_FILES = ("tests/integrations/vllm/cases_cache_specs.py", "tests/integrations/vllm/cases_block_tables.py",
              "tests/integrations/vllm/cases_validation.py", "tests/integrations/vllm/cases_connectors.py",
              "tests/integrations/vllm/cases_hooks.py", "tests/integrations/vllm/cases_compile_modes.py",
              "tests/integrations/vllm/cases_breakable_graphs.py", "tests/integrations/vllm/cases_owner_calls.py",
              "tests/integrations/vllm/cases_context_gathers.py", "tests/integrations/vllm/cases_host_sync.py",
              "tests/integrations/vllm/cases_context_stream.py", "tests/integrations/vllm/cases_deepseek_v4.py",
              "tests/integrations/vllm/cases_deepseek_v32.py")


def _case_names() -> list[str]:
    """Every ``test_*`` function of the case files, read from their source (collecting them would import
    vLLM into this process)."""
    import ast

    names = []
    for case_file in CASE_FILES:
        tree = ast.parse((ROOT / case_file).read_text())
        names += [f"{Path(case_file).stem}::{node.name}" for node in tree.body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    return names


@pytest.fixture(scope="module")
def vllm_object_cases(tmp_path_factory) -> dict[str, list[tuple[str, str]]]:
    """One pytest process of its own runs every case against vLLM's real classes; its JUnit report gives
    each case's outcomes (one per parametrization): {"file::test": [(outcome, message), ...]}."""
    import xml.etree.ElementTree as ElementTree

    report = tmp_path_factory.mktemp("vllm_objects") / "report.xml"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                          *CASE_FILES], cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert report.exists(), out.stdout[-4000:] + out.stderr[-2000:]
    cases: dict[str, list[tuple[str, str]]] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name').split('[')[0]}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome, message = kind, (found.get("message") or "") + "\n" + (found.text or "")[-3000:]
        cases.setdefault(name, []).append((outcome, message))
    return cases


@pytest.mark.parametrize("case", _case_names())
def test_against_vllm_objects(vllm_object_cases, case):
    """Specs, validation, hooks and the step's host work against vLLM's real classes: each case of the case
    files, run in a pytest process of its own, is one result here; a case that did not run fails."""
    outcomes = vllm_object_cases.get(case)
    assert outcomes, f"{case} did not run: {sorted(vllm_object_cases)[:5]}..."
    failed = [message for outcome, message in outcomes if outcome != "passed"]
    assert not failed, "\n".join(failed)


def test_every_vllm_object_case_is_reported(vllm_object_cases):
    """The names read from the source are exactly the cases the process ran: none runs unreported here."""
    names = _case_names()
    assert len(names) >= 50 and len(set(names)) == len(names)
    assert set(vllm_object_cases) == set(names)
    assert sum(len(outcomes) for outcomes in vllm_object_cases.values()) >= 70
