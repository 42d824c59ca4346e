"""No call to a name macOS's Python lacks without a guard, and macOS asked through one seam.

Read from the source with `ast` (nothing runs). A use of a Linux-only name (the table in
tests/support/macos_surface.py: `os.posix_fadvise`, `select.epoll`, `/proc/...`) must stand
where its absence is handled:

* inside an `if` (or `and`, or conditional expression) that tests `hasattr(module, "name")`,
  `getattr(module, "name", ...)`, `sys.platform` or `macos.on_macos()`;
* inside a `try` that catches AttributeError (or Exception);
* or as `getattr(module, "name", default)`;

or be listed in ALLOWED with the reason it is safe. And only mlx_kvserve/macos.py compares
`sys.platform` with "darwin": every other macOS branch asks `macos.on_macos()`, the seam the tests
replace to run it on Linux (tests/unit/test_macos_paths.py).
"""

from __future__ import annotations

import ast
import selectors
import sys
from pathlib import Path

import pytest

from tests.support import macos_surface
from tests.support.macos_surface import LINUX_ONLY

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mlx_kvserve"
SEAM = PACKAGE / "macos.py"

# (file relative to the package, the name used) -> why it is safe there.
ALLOWED: dict[tuple[str, str], str] = {
    ("models/pressure.py", "/proc/pressure/memory"): (
        "a path constant: read only where OSError is caught and after exists() is checked; "
        "macOS, with no /proc, takes the sysctl branch"
    ),
}

GUARD_ERRORS = {"AttributeError", "Exception", "BaseException"}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the module it stands for (`import os`, `import select as sel`)."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in LINUX_ONLY:
                    found[alias.asname or alias.name] = alias.name
    return found


def _uses(tree: ast.Module, aliases: dict[str, str]) -> list[tuple[ast.AST, str]]:
    """(node, the Linux-only name it uses) for every use in the module."""
    uses: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module and node.attr in LINUX_ONLY[module]:
                uses.append((node, f"{module}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module in LINUX_ONLY:
            for alias in node.names:
                if alias.name in LINUX_ONLY[node.module]:
                    uses.append((node, f"{node.module}.{alias.name}"))
        elif _is_call(node, "getattr") and len(node.args) == 2:
            name = _string(node.args[1])
            module = aliases.get(getattr(node.args[0], "id", ""))
            if module and name in LINUX_ONLY[module]:
                uses.append((node, f"{module}.{name}"))
        elif (_string(node) or "").startswith("/proc/"):
            uses.append((node, _string(node) or ""))
    return uses


def _is_call(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _named(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_guard_test(test: ast.AST, aliases: dict[str, str]) -> bool:
    """A condition that asks whether a Linux-only name exists (`hasattr(os, "posix_fadvise")`
    covers its POSIX_FADV_* constants too), or which platform this is."""
    for node in ast.walk(test):
        if (_is_call(node, "hasattr") or _is_call(node, "getattr")) and len(node.args) >= 2:
            module = aliases.get(getattr(node.args[0], "id", ""))
            if module and _string(node.args[1]) in LINUX_ONLY[module]:
                return True
        if isinstance(node, ast.Attribute) and (
            node.attr == "on_macos" or (node.attr == "platform" and _named(node.value, "sys"))
        ):
            return True
    return False


def _catches_attribute_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(getattr(n, "id", None) in GUARD_ERRORS for n in names)


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST], aliases: dict[str, str]) -> bool:
    child, parent = node, parents.get(node)
    while parent is not None:
        if _guards(parent, child, aliases):
            return True
        child, parent = parent, parents.get(parent)
    return False


def _guards(parent: ast.AST, child: ast.AST, aliases: dict[str, str]) -> bool:
    """Whether `parent` handles a missing name for what stands in its `child`."""
    if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and child is not parent.test:
        return _is_guard_test(parent.test, aliases)
    if isinstance(parent, ast.BoolOp) and isinstance(parent.op, ast.And):
        earlier = parent.values[: parent.values.index(child)]
        return any(_is_guard_test(value, aliases) for value in earlier)
    if isinstance(parent, ast.Try) and child in parent.body:
        return any(_catches_attribute_error(h) for h in parent.handlers)
    return False


def unguarded(source: str) -> list[tuple[int, str]]:
    """(line, name) of every use of a Linux-only name in `source` that nothing guards."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node, name in _uses(tree, aliases):
        if not _guarded(node, parents, aliases):
            found.append((getattr(node, "lineno", 0), name))
    return sorted(found)


def darwin_comparisons(source: str) -> list[int]:
    """Lines that compare `sys.platform` with "darwin" (the seam's job)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            platform = any(isinstance(p, ast.Attribute) and p.attr == "platform" for p in parts)
            if platform and any(_string(p) == "darwin" for p in parts):
                lines.append(node.lineno)
    return lines


def _package_sources() -> list[tuple[str, str]]:
    return [
        (path.relative_to(PACKAGE).as_posix(), path.read_text(encoding="utf-8"))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def test_the_check_finds_an_unguarded_call_and_accepts_guarded_ones() -> None:
    source = """
import os
import select as sel

def bare(fd):
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)

def by_hasattr(fd):
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)

def by_try():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 1

def by_default():
    return getattr(os, "pipe2", None), getattr(os, "pipe2")

def by_and():
    return hasattr(sel, "epoll") and sel.epoll()

def by_platform():
    if sys.platform.startswith("linux"):
        return open("/proc/pressure/memory").read()
    return os.fdatasync
"""
    assert unguarded(source) == [
        (6, "os.POSIX_FADV_WILLNEED"),
        (6, "os.posix_fadvise"),
        (19, "os.pipe2"),
        (27, "os.fdatasync"),
    ]


def test_no_unguarded_linux_only_call_in_the_package() -> None:
    found = []
    for name, source in _package_sources():
        for line, used in unguarded(source):
            if (name, used) not in ALLOWED:
                found.append(f"mlx_kvserve/{name}:{line}: {used}")
    assert not found, (
        "Linux-only names used without a guard (macOS's Python lacks them; see "
        "tests/support/macos_surface.py):\n" + "\n".join(found)
    )


def test_every_allowance_is_still_needed() -> None:
    used = {(name, u) for name, source in _package_sources() for _, u in unguarded(source)}
    assert set(ALLOWED) <= used, f"stale ALLOWED entries: {set(ALLOWED) - used}"


def test_only_the_seam_asks_for_darwin() -> None:
    assert darwin_comparisons('import sys\nif sys.platform == "darwin":\n    pass\n') == [2]
    assert darwin_comparisons(SEAM.read_text(encoding="utf-8")), "the seam itself asks"
    found = [
        f"mlx_kvserve/{name}:{line}"
        for name, source in _package_sources()
        if name != "macos.py"
        for line in darwin_comparisons(source)
    ]
    assert not found, "ask macos.on_macos() instead (tests can run it on Linux):\n" + "\n".join(
        found
    )


def test_the_macos_surface_is_in_place_when_asked() -> None:
    """The run with MLX_KVSERVE_TEST_MACOS_OS=1 (.ci/run) really lacks what macOS lacks."""
    if not macos_surface.requested():
        pytest.skip(f"{macos_surface.ENV} is not set: this run has Linux's os surface")
    assert macos_surface.removed
    for module, names in LINUX_ONLY.items():
        lacking = [name for name in names if hasattr(sys.modules[module], name)]
        assert not lacking, f"{module} still has {lacking}"
    assert not hasattr(selectors, "EpollSelector")
