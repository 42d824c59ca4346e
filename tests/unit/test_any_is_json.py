"""`typing.Any` only for JSON values.

A collaborator typed `Any` tells a reader nothing and a type checker less: it should be a class,
a `Protocol` or a `Callable[...]`. What is really untyped is JSON, a recursive value that crosses
the wire; its one alias lives in `mlx_kvserve/json_value.py`. The package is read with `ast` (no
import runs) and every use of `Any` is reported, except:

- in the alias module itself;
- as the value type of a str-keyed mapping (`dict[str, Any]`, `Mapping[str, Any]`,
  `MutableMapping[str, Any]`), which in this codebase is a JSON object (new code writes
  `dict[str, JSON]`), wherever that mapping stands (`list[dict[str, Any]]` too).

Annotations written as strings are parsed and checked like the others.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "mlx_kvserve"
ALIAS_MODULE = "mlx_kvserve/json_value.py"

# Modules other branches are converting: their uses of `Any` are allowed for now.
# The integrator removes an entry when the branch that converts it lands.
STILL_CONVERTING: frozenset[str] = frozenset()


def _any_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to `typing.Any` (`from typing import Any as X`) and to `typing` itself."""
    names: set[str] = set()
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("typing", "typing_extensions"):
            names.update(a.asname or a.name for a in node.names if a.name == "Any")
        elif isinstance(node, ast.Import):
            modules.update(
                a.asname or a.name for a in node.names if a.name in ("typing", "typing_extensions")
            )
    return names, modules


class _Finder(ast.NodeVisitor):
    """The lines of every `Any`."""

    def __init__(
        self, names: set[str], modules: set[str], annotations: set[int], line_offset: int = 0
    ) -> None:
        self.names = names  # what `typing.Any` is called here
        self.modules = modules  # what `typing` is called here
        self.annotations = annotations  # ids of the string constants that are annotations
        self.line_offset = line_offset
        self.lines: list[int] = []

    def _is_any(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "Any"
            and isinstance(node.value, ast.Name)
            and node.value.id in self.modules
        )

    def visit_Name(self, node: ast.Name) -> None:
        self._check(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check(node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        """A string annotation (`x: "dict[str, Any]"`) is checked like a written one."""
        if id(node) not in self.annotations or not isinstance(node.value, str):
            return
        try:
            inner = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return
        finder = _Finder(self.names, self.modules, set(), self.line_offset + node.lineno - 1)
        finder.visit(inner)
        self.lines.extend(finder.lines)

    def _check(self, node: ast.expr) -> None:
        if self._is_any(node):
            self.lines.append(node.lineno + self.line_offset)


def _string_annotations(tree: ast.Module) -> set[int]:
    """The ids of the string constants standing where an annotation goes, or inside one."""
    roots: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.returns is not None:
                roots.append(node.returns)
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None and arg.annotation is not None:
                    roots.append(arg.annotation)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
    return {id(n) for root in roots for n in ast.walk(root) if isinstance(n, ast.Constant)}


def any_uses(source: str) -> list[int]:
    """The lines of `source` that use `Any`."""
    tree = ast.parse(source)
    names, modules = _any_names(tree)
    if not names and not modules:
        return []
    finder = _Finder(names, modules, _string_annotations(tree))
    finder.visit(tree)
    return sorted(finder.lines)


def _checked_modules() -> list[Path]:
    paths = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == ALIAS_MODULE or any(rel.startswith(entry) for entry in STILL_CONVERTING):
            continue
        paths.append(path)
    return paths


def test_the_finder_sees_any() -> None:
    """Each form a use of `Any` can take is found, `dict[str, Any]` too: `dict[str, JSON]`."""
    source = "\n".join(
        [
            "import typing",
            "from typing import Any, Mapping",
            "from typing import Any as Whatever",
            "a: Any",
            "b: dict[str, Any]",
            "c: list[dict[str, Any]]",
            "d: Mapping[str, Any]",
            "e: dict[int, Any]",
            "f: typing.Any",
            "g: 'Any'",
            "h: 'dict[str, Any]'",
            "def k(x: Whatever) -> list[Any]: ...",
            "m = cast(Any, None)",
            "n: typing.Dict[str, typing.Any]",
        ]
    )
    assert any_uses(source) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 12, 13, 14]


def test_the_allowlist_names_real_modules() -> None:
    """An entry for a module that no longer exists is stale and would hide a new one."""
    for entry in STILL_CONVERTING:
        assert (ROOT / entry).exists(), f"{entry} is in STILL_CONVERTING but does not exist"


def test_any_only_for_json_values() -> None:
    """Every use of `Any` in the package (still-converting modules aside), reported together."""
    found = []
    for path in _checked_modules():
        for line in any_uses(path.read_text(encoding="utf-8")):
            found.append(f"{path.relative_to(ROOT).as_posix()}:{line}")
    assert not found, (
        "`Any` outside a JSON value (use a class, a Protocol, a Callable[...] or "
        "mlx_kvserve.json_value.JSON):\n" + "\n".join(found)
    )
