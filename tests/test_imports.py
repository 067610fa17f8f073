"""The import direction of DESIGN.md, read from the sources: the compiler never imports the runtime, the
runtime's modules import each other without a cycle, only the command line and the integrations import an
integration, and docs/design.md's layers name every package and top-level module."""

from __future__ import annotations

import ast
import re
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
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            module = node.module
            if node.level:  # relative: resolved against the module's own package
                package = module_name(path).split(".")[:None if path.name == "__init__.py" else -1]
                module = ".".join(package[:len(package) - node.level + 1] + ([module] if module else []))
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
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
    """The vLLM integration's config, topology, schedule and the cache's spec and placement are plain Python
    (docs/design.md): neither they nor what they import imports torch when loaded (topology's process-group
    helpers import it when called)."""
    for name in ("kvpp_fx.integrations.vllm.setup.config", "kvpp_fx.topology", "kvpp_fx.schedule",
                 "kvpp_fx.cache.spec", "kvpp_fx.cache.placement", "kvpp_fx.passes.sources"):
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
    assert "pydantic" in _loaded_after("import kvpp_fx.integrations.vllm.setup.config")


def test_the_vllm_plugin_loads_no_torch():
    """vLLM loads the plugin (the ``vllm.general_plugins`` entry point) in every process: importing it loads its
    configuration (pydantic) but neither torch nor another part of the integration. The control: the
    configuration module is loaded."""
    loaded = _loaded_after("import kvpp_fx.integrations.vllm.plugin")
    assert "torch" not in loaded
    assert sorted(m for m in loaded if m.startswith("kvpp_fx.integrations.")) == [
        "kvpp_fx.integrations.vllm", "kvpp_fx.integrations.vllm.plugin", "kvpp_fx.integrations.vllm.setup",
        "kvpp_fx.integrations.vllm.setup.config"]


def test_every_public_name_resolves():
    import kvpp_fx

    assert len(kvpp_fx.__all__) >= 20
    for name in kvpp_fx.__all__:
        assert getattr(kvpp_fx, name) is not None, name
    # The control: a name outside the list does not resolve.
    import pytest

    with pytest.raises(AttributeError):
        kvpp_fx.NotAName  # noqa: B018


def test_importing_the_command_line_loads_no_torch():
    """``kvpp-fx --help`` stays cheap: the CLI package and its parser import neither torch, pydantic nor an
    integration; each command imports what it needs when it runs. (The helper's controls are above.)"""
    loaded = _loaded_after("import kvpp_fx.cli; kvpp_fx.cli.build_parser()")
    assert {"torch", "pydantic"} & loaded == set()
    assert sorted(m for m in loaded if m.startswith("kvpp_fx.integrations")) == []


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# The layers above the core (docs/design.md): only they may import an integration.
IMPORTERS_OF_INTEGRATIONS = ("kvpp_fx.cli", "kvpp_fx.integrations")


def test_only_the_command_line_and_the_integrations_import_an_integration():
    """No module outside kvpp_fx/cli/ and kvpp_fx/integrations/ imports kvpp_fx.integrations, at any depth of
    its code (lazy imports included). The control: the CLI's plan report does, lazily."""
    core = sorted(name for name in MODULES if not any(in_package(name, p) for p in IMPORTERS_OF_INTEGRATIONS))
    assert len(core) >= 40 and "kvpp_fx" in core and "kvpp_fx.backend" in core
    found = {name: sorted(m for m in imports_of(MODULES[name]) if in_package(m, "kvpp_fx.integrations"))
             for name in core}
    assert {name: imported for name, imported in found.items() if imported} == {}
    assert "kvpp_fx.integrations.vllm.attention.backends" in imports_of(MODULES["kvpp_fx.cli.plan_report"])


def test_the_modes_are_imported_from_the_cost_model(tmp_path):
    """`Mode` and `KVPP_MODES` are the cost model's (kvpp_fx.cache.cost): the vLLM integration's
    configuration (kvpp_fx.integrations.vllm.setup.config) uses them but is not where anyone imports them
    from. The control: such an import is found."""
    root = PACKAGE.parent
    sources = [p for d in ("kvpp_fx", "tests", "benchmarks") for p in (root / d).rglob("*.py")]
    config = "kvpp_fx.integrations.vllm.setup.config"
    reexported = {f"{config}.Mode", f"{config}.KVPP_MODES"}
    assert sorted(str(p.relative_to(root)) for p in sources if imports_of(p) & reexported) == []
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from kvpp_fx.integrations.vllm.setup.config import KVPPConfig, Mode\n")
    assert imports_of(planted) & reexported == {f"{config}.Mode"}


DESIGN = PACKAGE.parent / "docs" / "design.md"
LAYERS_HEADING = "## Layers (imports only point down)"


def layers_named(text: str) -> set[str]:
    """The paths in the left column of the layers block under `LAYERS_HEADING` (``cli/``, ``backend.py``): a
    line that does not start with a space names its entries, comma-separated, before its first run of two
    spaces."""
    block = text.split(LAYERS_HEADING, 1)[1].split("```", 2)[1]
    named = set()
    for line in block.splitlines():
        if line and not line[0].isspace():
            named |= {name.strip() for name in re.split(r"\s{2,}", line, maxsplit=1)[0].split(",")}
    return named


def package_entries() -> set[str]:
    """kvpp_fx's top-level modules (``backend.py``, ``__main__.py``) and its packages at any depth
    (``cache/``, ``integrations/vllm/``)."""
    modules = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    packages = {f"{p.parent.relative_to(PACKAGE).as_posix()}/" for p in PACKAGE.rglob("__init__.py")}
    return modules | (packages - {"./"})


def test_the_design_layers_name_every_package_and_module():
    """docs/design.md's layers block names every package and top-level module of kvpp_fx, and nothing that is
    not one (a package named names its parents: ``integrations/vllm/`` names ``integrations/``). The control:
    the parser reads the left column only, and sees both kinds of entry."""
    named = layers_named(DESIGN.read_text())
    parents = {"/".join(n.split("/")[:k]) + "/" for n in named if n.endswith("/") for k in range(1, n.count("/"))}
    entries = package_entries()
    assert {"cli/", "integrations/vllm/", "backend.py", "__main__.py"} <= entries
    assert sorted(entries - named - parents) == [], "missing from docs/design.md's layers"
    assert sorted(named - entries) == [], "named in docs/design.md's layers but not in kvpp_fx/"
    sample = f"{LAYERS_HEADING}\n\n```\nops.py, cache/   the ops, plan.py\n        runtime/, x.py\n```\nnot.py  x\n"
    assert layers_named(sample) == {"ops.py", "cache/"}


LINE_LIMITS = {"runtime": 350}  # a package's own limit; 400 elsewhere
DEFAULT_LINE_LIMIT = 400


def oversized(paths, root=PACKAGE) -> list[tuple[str, int]]:
    """The files of `paths` (under `root`) over their package's line limit (`LINE_LIMITS`)."""
    out = []
    for path in paths:
        package = path.relative_to(root).parts[0]
        lines = len(path.read_text().splitlines())
        if lines > LINE_LIMITS.get(package, DEFAULT_LINE_LIMIT):
            out.append((str(path.relative_to(root)), lines))
    return out


def test_no_source_file_outgrows_its_limit(tmp_path):
    """Every file under kvpp_fx/ holds at most 400 lines, the runtime's at most 350. The control: a runtime
    file of 351 lines is found, a cache file of 400 lines is not."""
    assert oversized(sorted(PACKAGE.rglob("*.py"))) == []
    (tmp_path / "runtime").mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "runtime" / "long.py").write_text("pass\n" * 351)
    (tmp_path / "cache" / "long.py").write_text("pass\n" * 400)
    assert oversized(sorted(tmp_path.rglob("*.py")), tmp_path) == [("runtime/long.py", 351)]
