"""The source tree's shape: no import circle between files, and no runtime module past about 400 lines.

The import graph is read from the source with `ast` (every import statement, also those inside functions and
under TYPE_CHECKING), so a circle that only a lazy import hides still counts."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("attention_nodes", "expert_nodes", "comm", "balancer", "kernels", "launch", "models")
MAX_LINES = 420     # "about 400"; Triton kernels are exempt (kernels/triton_*.py)


def _modules() -> dict[str, str]:
    """module name -> file path, for every .py file of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import name` counts as pkg.name when that is a
    module, else as pkg)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle_between_files():
    modules = _modules()
    graph = import_graph(modules)
    assert "launch.runtime.membership" in graph["launch.runtime.runtime"]   # the reader sees real imports
    assert cycles(graph) == []


def test_no_runtime_module_over_about_400_lines():
    long = {}
    for mod, path in _modules().items():
        if os.path.basename(path).startswith("triton_"):
            continue
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[mod] = n
    assert long == {}
