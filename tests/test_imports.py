"""The import direction of DESIGN.md, read from the sources: the compiler never imports the runtime, no
kvpp_fx module is on an import cycle (lazy imports included), only the command line and the integrations
import an integration, and docs/design.md's layers name every package and top-level module."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvpp_fx"
# The calls that import the module a string literal names: ``importlib.import_module("kvpp_fx.x")``.
IMPORT_CALLS = ("import_module", "__import__")


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of the module at `path` in the package `root` (a package: its folder's name)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _walk(node: ast.AST, lazy: bool) -> Iterator[ast.AST]:
    """`node` and the nodes below it; with `lazy` false, none inside a function (what an import runs)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if lazy or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, lazy)


def imported_names(path: Path, root: Path = PACKAGE, lazy: bool = True) -> list[tuple[str, str | None]]:
    """What the code of `path` imports, as (module, name) pairs: ``import a.b`` is ("a.b", None), ``from a
    import b`` is ("a", "b") (b a module or a name in a), ``importlib.import_module("a.b")`` (or
    ``__import__``) with a literal is ("a.b", None). Relative imports are resolved. With `lazy` (the
    default) at any depth of the code (functions, TYPE_CHECKING blocks); without, what importing it runs."""
    found: list[tuple[str, str | None]] = []
    for node in _walk(ast.parse(path.read_text()), lazy):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            module = node.module
            if node.level:  # relative: resolved against the module's own package
                package = module_name(path, root).split(".")[:None if path.name == "__init__.py" else -1]
                module = ".".join(package[:len(package) - node.level + 1] + ([module] if module else []))
            found += [(module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in IMPORT_CALLS and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, None))
    return found


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def imports_of(path: Path, root: Path = PACKAGE) -> set[str]:
    """Every module of `root`'s package (kvpp_fx) that `path` imports, at any depth of its code (lazy
    imports, TYPE_CHECKING ones and ``importlib.import_module`` of a literal included), and every
    ``module.name`` it imports from one."""
    found = set()
    for module, name in imported_names(path, root):
        found |= {module} if name is None else {module, f"{module}.{name}"}
    return {name for name in found if in_package(name, root.name)}


def modules_of(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in root.rglob("*.py")}


MODULES = modules_of(PACKAGE)


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


BODY = ".__init__"  # the node of a package's body: what importing one of its modules runs of it


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of `root`'s package its code depends on, lazy imports included, for finding
    cycles. An import depends on the module it names (``from a.b import c``: a.b, or a.b.c where c is a
    module) and on the bodies of the packages above it (node ``a.__init__``), which importing it first
    runs (not those above the importer: they ran before it). A package's body depends only on what it
    imports when it runs: a package's lazy ``__getattr__`` (``kvpp_fx.integrations.vllm.backend``) is
    the package's own dependency, a module's only where the module imports that package's name."""
    modules = modules_of(root)
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}

    def depends(path: Path, lazy: bool) -> set[str]:
        out = set()
        importer = module_name(path, root)
        above = {".".join(importer.split(".")[:k]) for k in range(1, importer.count(".") + 2)}
        for module, name in imported_names(path, root, lazy):
            dotted = module if name is None else f"{module}.{name}"
            if not in_package(dotted, root.name):
                continue
            parts = dotted.split(".")
            prefixes = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
            target = next(p for p in reversed(prefixes) if p in modules)
            out.add(target)
            # The bodies of the packages above the importer ran before it (a package's own body included).
            out |= {p + BODY for p in prefixes[:prefixes.index(target)] if p in packages and p not in above}
        return out

    graph = {name: depends(path, lazy=True) for name, path in modules.items()}
    graph |= {name + BODY: depends(modules[name], lazy=False) for name in packages}
    return graph


def on_cycles(graph: dict[str, set[str]]) -> list[str]:
    """The nodes of `graph` that reach themselves."""
    return sorted(name for name in graph if name in closure(name, lambda n: graph.get(n, ())))


def test_no_pass_reaches_the_runtime():
    passes = sorted(name for name in MODULES if name.startswith("kvpp_fx.passes"))
    assert len(passes) >= 8
    reached = {name: sorted(m for m in closure(name) if m.startswith("kvpp_fx.runtime")) for name in passes}
    assert {name: found for name, found in reached.items() if found} == {}
    # The control: the backend, which joins the passes and the runtime, does reach it.
    assert "kvpp_fx.runtime.graph_ops" in closure("kvpp_fx.backend")


def test_no_module_is_on_an_import_cycle():
    """No kvpp_fx module reaches itself through imports, lazy ones (in a function, under TYPE_CHECKING,
    ``importlib.import_module`` of a literal) included: two modules that need each other, even lazily, are
    one concern split in two (the vLLM connectors were, through a lazy import). The runtime's and the
    integration's modules are all walked."""
    graph = import_graph()
    assert len([name for name in graph if name.startswith("kvpp_fx.runtime.")]) >= 10
    assert len([name for name in graph if name.startswith("kvpp_fx.integrations.vllm.")]) >= 25
    assert on_cycles(graph) == []
    # The control: the package bodies are nodes, and a module that imports a package's name depends on
    # the package's lazy attribute (the vLLM package's ``backend``).
    assert "kvpp_fx.integrations.vllm.attention.compilation" in graph["kvpp_fx.integrations.vllm"]
    assert graph["kvpp_fx.integrations.vllm" + BODY] == set()


def test_the_cycle_walk_finds_lazy_circles(tmp_path):
    """The control of the cycle test, on a planted package: a circle closed by a function's import (the
    connectors' former one), one closed by ``importlib.import_module`` of a literal and a lazy relative
    import, and one through TYPE_CHECKING are found; a module that imports into a circle, and a
    package's lazy ``__getattr__`` that imports one of its modules, are not on one."""
    package = tmp_path / "planted"
    package.mkdir()
    sources = {
        "__init__.py": "def __getattr__(name):\n    from planted import e\n    return e\n",
        "connectors.py": "def route():\n    from planted import mooncake\n    return mooncake\n",
        "mooncake.py": "from planted.connectors import route\n",
        "c.py": "import importlib\n\ndef load():\n    return importlib.import_module('planted.d')\n",
        "d.py": "def load():\n    from . import c\n    return c\n",
        "t1.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from planted.t2 import T\n",
        "t2.py": "import planted.t1\n\nT = 1\n",
        "e.py": "import planted.mooncake\nfrom planted import c\n",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert on_cycles(graph) == ["planted.c", "planted.connectors", "planted.d", "planted.mooncake",
                                "planted.t1", "planted.t2"]
    assert graph["planted"] == {"planted.e"} and graph["planted" + BODY] == set()
    # The synthetic graph: a cycle is found where there is one, and none where there is none.
    synthetic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert on_cycles(synthetic) == ["a", "b", "c"]


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


# The vLLM integration's modules at the paths its docs give users: each only names what a subpackage defines.
DOCUMENTED_PATHS = {"kvpp_fx.integrations.vllm.connectors": "kvpp_fx.integrations.vllm.kv_connectors",
                    "kvpp_fx.integrations.vllm.worker": "kvpp_fx.integrations.vllm.engine"}


def only_names(path: Path, package: str) -> list[str] | None:
    """The names a module's body imports from `package` and lists in ``__all__``, where its body is only
    that (a docstring, such imports, ``__all__``, and a module ``__getattr__`` that imports names of
    `package` when first asked for); None otherwise."""
    names, listed = [], None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "typing":
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and in_package(node.module, package):
            names += [alias.asname or alias.name for alias in node.names]
        elif isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            lazy = [n for n in ast.walk(node) if isinstance(n, ast.ImportFrom)]
            if not lazy or not all(n.level == 0 and in_package(n.module, package) for n in lazy):
                return None
            names += [alias.asname or alias.name for n in lazy for alias in n.names]
        elif (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
              and isinstance(node.value, ast.List | ast.Tuple)):
            listed = [element.value for element in node.value.elts]
        else:
            return None
    return sorted(names) if listed is not None and sorted(listed) == sorted(names) else None


def test_the_documented_paths_only_name_the_subpackages_objects(tmp_path):
    """``kvpp_fx.integrations.vllm.connectors`` (what ``kv_connector_module_path`` names: vLLM's factory
    reads KVPP's connector classes there) and ``kvpp_fx.integrations.vllm.worker`` (``worker_stats``) define
    nothing. The control: a module that also defines something is seen."""
    assert only_names(MODULES["kvpp_fx.integrations.vllm.connectors"], DOCUMENTED_PATHS[
        "kvpp_fx.integrations.vllm.connectors"]) == [
        "ExampleConnector", "MooncakeConnector", "NixlConnector", "NixlPullConnector"]
    assert only_names(MODULES["kvpp_fx.integrations.vllm.worker"], DOCUMENTED_PATHS[
        "kvpp_fx.integrations.vllm.worker"]) == ["worker_stats"]
    from kvpp_fx.integrations.vllm.engine import stats
    from kvpp_fx.integrations.vllm.worker import worker_stats

    assert worker_stats is stats.worker_stats
    planted = tmp_path / "planted.py"
    planted.write_text('"""x"""\nfrom kvpp_fx.integrations.vllm.engine.stats import worker_stats\n\n'
                       '__all__ = ["worker_stats"]\nLIMIT = 1\n')
    assert only_names(planted, "kvpp_fx.integrations.vllm.engine") is None
    lazy = tmp_path / "lazy.py"  # a module __getattr__ that does more than import from the package
    lazy.write_text('"""x"""\n__all__ = ["worker_stats"]\n\n\ndef __getattr__(name):\n'
                    '    from kvpp_fx.integrations.vllm.engine.stats import worker_stats\n'
                    '    from kvpp_fx.runtime import stats\n    return worker_stats\n')
    assert only_names(lazy, "kvpp_fx.integrations.vllm.engine") is None


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
