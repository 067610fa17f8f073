"""The import direction of DESIGN.md, read from the sources: the compiler never imports the runtime, and the
runtime's modules import each other without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvpp_fx"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every kvpp_fx module `path` imports, at any depth of its code (lazy imports and TYPE_CHECKING ones
    included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name == "kvpp_fx" or name.startswith("kvpp_fx.")}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def module_level_imports(path: Path) -> set[str]:
    """The top-level names imported by the module's own body (not inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def imported_modules(name: str) -> list[str]:
    """The kvpp_fx modules `name` imports, with the packages each import runs (their ``__init__``)."""
    out = []
    for imported in imports_of(MODULES[name]):
        parts = imported.split(".")
        out += [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
    return [m for m in out if m in MODULES]


def closure(start: str, edges=imported_modules) -> set[str]:
    """The modules `start` reaches through imports; `start` itself only through a cycle."""
    seen: set[str] = set()
    todo = list(edges(start))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += edges(name)
    return seen


def test_no_pass_reaches_the_runtime():
    passes = sorted(name for name in MODULES if name.startswith("kvpp_fx.passes"))
    assert len(passes) >= 8
    reached = {name: sorted(m for m in closure(name) if m.startswith("kvpp_fx.runtime")) for name in passes}
    assert {name: found for name, found in reached.items() if found} == {}
    # The control: the backend, which joins the passes and the runtime, does reach it.
    assert "kvpp_fx.runtime.graph_ops" in closure("kvpp_fx.backend")


def test_the_runtime_has_no_import_cycle():
    runtime = {name for name in MODULES if name.startswith("kvpp_fx.runtime.")}
    assert len(runtime) >= 10
    cycles = sorted(name for name in runtime if name in closure(name))
    assert cycles == []
    # The control: the same walk finds a cycle where there is one, and none where there is none.
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert {"a", "b", "c"} <= closure("a", graph.__getitem__) and "d" not in closure("d", graph.__getitem__)


def test_the_plain_layers_import_no_torch():
    """config, topology, schedule and the cache's spec and placement are plain Python (DESIGN.md): neither
    they nor what they import imports torch when loaded (topology's process-group helpers import it when
    called)."""
    for name in ("kvpp_fx.config", "kvpp_fx.topology", "kvpp_fx.schedule", "kvpp_fx.cache.spec",
                 "kvpp_fx.cache.placement", "kvpp_fx.passes.sources"):
        for reached in (name, *closure(name)):
            assert "torch" not in module_level_imports(MODULES[reached]), (name, reached)
    # The control: a module that does import torch is seen.
    assert "torch" in module_level_imports(MODULES["kvpp_fx.ops"])


def _loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after `statement`."""
    import json
    import subprocess
    import sys

    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_kvpp_fx_loads_no_torch():
    """The vLLM plugin imports ``kvpp_fx`` in every vLLM process, the engine's included: it stays torch-free
    until a name is used. The control: using a runtime name does load torch."""
    assert "torch" not in _loaded_after("import kvpp_fx")
    assert "torch" in _loaded_after("import kvpp_fx; kvpp_fx.KVPPRuntime")


def test_the_runtime_loads_neither_pydantic_nor_an_integration():
    """The runtime reads its modes from the cost model, which is plain; pydantic is the vLLM configuration's.
    The control: the configuration module does load pydantic."""
    loaded = _loaded_after("import kvpp_fx.runtime.runtime")
    assert "pydantic" not in loaded
    assert sorted(m for m in loaded if m.startswith("kvpp_fx.integrations")) == []
    assert "pydantic" in _loaded_after("import kvpp_fx.config")


def test_every_public_name_resolves():
    import kvpp_fx

    assert len(kvpp_fx.__all__) >= 20
    for name in kvpp_fx.__all__:
        assert getattr(kvpp_fx, name) is not None, name
    # The control: a name outside the list does not resolve.
    import pytest

    with pytest.raises(AttributeError):
        kvpp_fx.NotAName  # noqa: B018
