"""No import cycles anywhere in ``src/mmtune``, found statically from every module's AST.

Two graphs are checked, each must be acyclic:

* **module level**: the imports that run when a module is imported (top of the file, class
  bodies, ``if``/``try`` blocks at module level). A cycle here can fail at import time
  with a half-initialised module, depending on which module is imported first;
* **module and function level together**: also the imports deferred into function
  bodies. Such a cycle always imports, but it is a back edge between layers (a
  lower room that reaches up into a higher one), which is what this test exists to
  keep out; counting it keeps the rooms of ``docs/architecture.md`` in one order.

Not counted: imports under ``if TYPE_CHECKING:`` (they never run), and imports by name
through ``importlib`` (the benchmark and adapter registries discover their built-in
modules that way; those modules are leaves that register themselves). ``from a.b import
c`` counts as importing the module ``a.b.c`` when there is one, else the package ``a.b``
(a package's own ``__init__`` importing its children is therefore no ring).

One layering rule on top (:func:`test_data_and_models_meet_only_in_the_contract_layer`):
``mmtune.core`` (the dialogue and encoded-example types, the ignore index, image limits
and image errors) imports nothing else of mmtune; ``mmtune.data`` and ``mmtune.models``
both build on it and never import each other, in either direction, at module level or in
a function. The one allowance: a ``data`` module may name the adapter contract
``mmtune.models.base.ModelAdapter`` in annotations, imported under ``if TYPE_CHECKING:``
(the caller hands the adapter in; nothing of ``models`` runs from ``data``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, modules: dict[str, Path], package: str) -> tuple[set[str], set[str]]:
    """(module-level targets, function-level targets) of one module, as module names of ``package``."""
    is_package = path.name == "__init__.py"
    top: set[str] = set()
    deferred: set[str] = set()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: None if is_package else -1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        # ``from pkg import sub`` imports the module ``pkg.sub``; ``from pkg import name`` the package
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]), in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in targets(child):
                    if name == package or name.startswith(package + "."):
                        found = known(name)
                        if found and found != module:
                            (deferred if in_function else top).add(found)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), False)
    return top, deferred


def find_cycles(root: Path, package: str) -> dict[str, list[list[str]]]:
    """``{"module level": [...], "with function level": [...]}``: each cycle as a list of
    modules that import each other in a ring (strongly connected components of size > 1)."""
    modules = _modules(root, package)
    edges = {name: _imports(name, path, modules, package) for name, path in modules.items()}
    graphs = {
        "module level": {m: top for m, (top, _) in edges.items()},
        "with function level": {m: top | deferred for m, (top, deferred) in edges.items()},
    }
    return {kind: _strongly_connected(graph) for kind, graph in graphs.items()}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the module graph is deep enough to matter for recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_import_cycles_in_mmtune():
    cycles = find_cycles(SRC, "mmtune")
    message = "\n".join(f"{kind}: {' <-> '.join(ring)}" for kind, rings in cycles.items() for ring in rings)
    assert cycles == {"module level": [], "with function level": []}, (
        "import cycles (move the shared code down a layer, or pass the object in from the caller):\n" + message)


def _type_checking_imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``from module import names`` under ``if TYPE_CHECKING:``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                if isinstance(child, ast.ImportFrom):
                    found.append((child.module or "", [alias.name for alias in child.names]))
                elif isinstance(child, ast.Import):
                    found += [(alias.name, []) for alias in child.names]
    return found


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_data_and_models_meet_only_in_the_contract_layer():
    modules = _modules(SRC, "mmtune")
    crossings = []
    for name, path in modules.items():
        top, deferred = _imports(name, path, modules, "mmtune")
        for target in sorted(top | deferred):
            if _in(name, "mmtune.core") and not _in(target, "mmtune.core"):
                crossings.append(f"{name} imports {target}: the contract layer imports nothing else of mmtune")
            for lower, other in (("mmtune.data", "mmtune.models"), ("mmtune.models", "mmtune.data")):
                if _in(name, lower) and _in(target, other):
                    crossings.append(f"{name} imports {target}")
        for target, names in _type_checking_imports(path):
            allowed = _in(name, "mmtune.data") and target == "mmtune.models.base" and names == ["ModelAdapter"]
            if not allowed and ((_in(name, "mmtune.data") and _in(target, "mmtune.models"))
                                or (_in(name, "mmtune.models") and _in(target, "mmtune.data"))):
                crossings.append(f"{name} imports {names} from {target} for annotations")
    assert crossings == [], (
        "data and models import each other (put the shared type in mmtune.core, or pass the object in):\n  "
        + "\n  ".join(crossings))


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_finder_sees_cycles_at_each_level_and_skips_type_checking(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "def f():\n    from pkg import a\n\nthing = 1\n",
        "pkg/sub/__init__.py": "from .c import x\n",
        "pkg/sub/c.py": "from ..sub import d\nx = 1\n",
        "pkg/sub/d.py": "import pkg.sub.c\n",
        "pkg/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.typed2 import T\n",
        "pkg/typed2.py": "import pkg.typed\nT = 1\n",
    })
    cycles = find_cycles(tmp_path, "pkg")
    # c -> d (relative "from ..sub import d") -> c is a ring at module level; the package's
    # __init__ importing its own child is not a ring by itself
    assert cycles["module level"] == [["pkg.sub.c", "pkg.sub.d"]]
    # a -> b at module level, b -> a inside a function: only the stricter graph has it
    assert cycles["with function level"] == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]


def test_no_test_module_imports_another():
    """Shared fixtures live in each test area's ``conftest.py``, shared helpers in ``tests/support/``:
    a test module importing another one would run that module's tests' imports and fixtures twice."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(tests)}: {name}" for name in names
                      if name.startswith("tests.") and name.rpartition(".")[2].startswith("test_")]
    assert found == []
