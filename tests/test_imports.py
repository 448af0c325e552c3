"""No import cycle among the project's modules.

Every module of ``icecache/``, ``baselines/``, ``evals/`` and ``run.py`` is parsed with ``ast`` (nothing is
imported). Each ``import`` and ``from ... import`` statement anywhere in a module -- at the top, inside a function
or a method, under a condition -- is an edge from that module to the project module it names: relative imports
are resolved against the importing module's package, ``from package import name`` points to the submodule
``package.name`` when that is a module and to the package's ``__init__`` otherwise, and imports of anything
outside the project are ignored. The test fails listing every cycle of that graph (one per strongly connected
group of modules), e.g. ``a -> b -> a``: a module that imports another one which, directly or through others,
imports it back, at load time or when a function runs.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("icecache", "baselines", "evals")


def project_modules() -> dict[str, Path]:
    """``{dotted name: path}`` of every project module (a package's name for its ``__init__.py``)."""
    modules = {"run": REPO / "run.py"}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".")
                if not is_package:
                    package = package[:-1]  # a module's relative imports start at its package
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of more than one module, or a module that
    imports itself (Tarjan's algorithm, then a shortest cycle through the group's first module)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:  # breadth first from the group's first module to one that imports it
        start = min(group)
        paths, queue = {start: [start]}, [start]
        for v in queue:
            if start in graph[v]:
                found.append(paths[v] + [start])
                break
            for w in sorted(graph[v] & group):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(found)


def test_the_graph_sees_relative_nested_and_package_imports():
    graph = import_graph()
    assert "icecache.kv.base" in graph["icecache.kv.cache"]  # from .base import ... (relative)
    assert "icecache.kv.compat" in graph["icecache.kv.cache"]  # from . import compat (a submodule)
    assert "evals.threads" in graph["evals.output.timing"]  # from .. import threads
    assert "evals.threads" in graph["run"]  # inside main(): from evals import threads
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}) == [["a", "b", "c", "a"],
                                                                                  ["d", "d"]]


def test_no_import_cycle_among_the_project_modules():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)
