"""The package's shape: no import cycles between the modules of `mlx_kvserve`.

The graph is read from the source with `ast` (no import runs): an edge A -> B for every
`import` or `from ... import` in A that names module B of the package, wherever it stands
(inside a function or under `TYPE_CHECKING` too: a cycle a type checker follows is still one a
reader has to hold in their head). `from pkg import name` counts as an import of `pkg.name` when
that is a module, else of `pkg` itself. A package's `__init__` that only re-exports its modules
for callers outside the package is left out of the graph; one that defines functions or classes
of its own (the CLI's parser) is a module like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "mlx_kvserve"

# Cycles other branches are breaking: a cycle is allowed while all its modules are in one entry.
# The integrator removes an entry when the branch that fixes it lands.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _packages(modules: dict[str, Path]) -> set[str]:
    return {name for name, path in modules.items() if path.name == "__init__.py"}


def _reexports_only(path: Path) -> bool:
    """An `__init__` that defines nothing of its own (imports, `__all__`, a docstring)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defines = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return not any(isinstance(node, defines) for node in tree.body)


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module a `from` import names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (re-exporting `__init__`s left out)."""
    modules = _modules()
    packages = _packages(modules)
    skipped = {name for name in packages if _reexports_only(modules[name])}
    graph: dict[str, set[str]] = {name: set() for name in modules if name not in skipped}
    for name in graph:
        tree = ast.parse(modules[name].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node, name in packages)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                if target in graph and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in component)
    return "{" + ", ".join(sorted(component)) + "}: " + "; ".join(edges)


def test_the_graph_sees_imports() -> None:
    """The reader finds real edges (a graph with none would have no cycles either)."""
    graph = import_graph()
    assert "mlx_kvserve.engine.sequence" in graph["mlx_kvserve.engine.batch"]
    assert "mlx_kvserve.engine.requests" in graph["mlx_kvserve.engine.worker"]


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]


def test_no_new_import_cycles() -> None:
    """Every cycle in the package, reported together; only the known ones are allowed."""
    graph = import_graph()
    unexpected = [c for c in cycles(graph) if not any(c <= known for known in KNOWN_CYCLES)]
    assert not unexpected, "import cycles:\n" + "\n".join(_describe(c, graph) for c in unexpected)
