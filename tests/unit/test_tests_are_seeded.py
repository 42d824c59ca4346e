"""Every test that samples names its seed, so no test passes or fails by the draw.

Read from the tests' source (AST), over tests/**: a request body (a dict literal, or a call's
keywords together with the dict literals passed to it, as `extra_body=` or `json=`) that sets a
`temperature` above 0 must set a `seed` too; so must an engine-level `SamplingParams(...)` or
`Sampling(...)` that samples (their default temperature samples). A request whose sampling is
left to the server's default is seeded by the test servers' `--seed` (tests/support/servers.py).

Only what can be read for certain is judged: a temperature that is a number (or a module-level
name bound to one), never a computed value; a body with `**` spread in it might carry its seed
and is let be, and so is a body bound to a name that the same function seeds later (`**body` in
a call or a dict with a seed, `body["seed"] = ...`, `body.update(seed=...)`). A sample that is
meant to be random says so with `# unseeded: <why>` on the temperature's line.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mlx_kvserve.chat.request import Sampling
from mlx_kvserve.engine.requests import SamplingParams

TESTS = Path(__file__).resolve().parents[1]
MARK = "# unseeded:"
# Constructors whose temperature defaults to sampling, and their first positional field.
SAMPLERS = {
    kind.__name__: next(f.default for f in dataclasses.fields(kind) if f.name == "temperature")
    for kind in (SamplingParams, Sampling)
}


@dataclass(frozen=True)
class Unseeded:
    path: str
    line: int
    temperature: float

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: temperature {self.temperature} without a seed"


def _constants(tree: ast.Module) -> dict[str, float]:
    """Module-level `NAME = <number>` bindings."""
    out: dict[str, float] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            if isinstance(target, ast.Name) and _is_number(value):
                out[target.id] = float(value.value)  # type: ignore[attr-defined]
    return out


def _is_number(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    )


def _number(node: ast.expr, constants: dict[str, float]) -> float | None:
    if _is_number(node):
        return float(node.value)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _dict_fields(node: ast.Dict) -> tuple[dict[str, ast.expr], bool]:
    """A dict literal's constant string keys, and whether it has a `**` spread."""
    fields = {k.value: v for k, v in zip(node.keys, node.values, strict=True) if _is_str(k)}
    return fields, any(k is None for k in node.keys)


def _is_str(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _seeded_names(scope: ast.AST) -> set[str]:
    """Names that `scope` gives a seed: `f(**name, seed=...)`, `{**name, "seed": ...}`,
    `name["seed"] = ...`, `name.update(seed=...)` or `name.update({"seed": ...})`."""
    out: set[str] = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Call):
            named = {k.arg for k in node.keywords}
            spread = [k.value for k in node.keywords if k.arg is None]
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "update":
                seeds = "seed" in named or any(
                    isinstance(a, ast.Dict) and "seed" in _dict_fields(a)[0] for a in node.args
                )
                if seeds and isinstance(func.value, ast.Name):
                    out.add(func.value.id)
            if "seed" in named:
                out |= {v.id for v in spread if isinstance(v, ast.Name)}
        elif isinstance(node, ast.Dict) and "seed" in _dict_fields(node)[0]:
            out |= {
                v.id
                for k, v in zip(node.keys, node.values, strict=True)
                if k is None and isinstance(v, ast.Name)
            }
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and _is_str(target.slice)
                    and target.slice.value == "seed"  # type: ignore[attr-defined]
                ):
                    out.add(target.value.id)
    return out


def _bound_names(tree: ast.Module) -> dict[int, tuple[str, ast.AST]]:
    """For each value assigned to a plain name: (the name, its enclosing function or module)."""
    out: dict[int, tuple[str, ast.AST]] = {}

    def visit(scope: ast.AST, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else scope
            if isinstance(child, ast.Assign) and len(child.targets) == 1:
                target = child.targets[0]
                if isinstance(target, ast.Name):
                    out[id(child.value)] = (target.id, scope)
            visit(inner, child)

    visit(tree, tree)
    return out


def unseeded(source: str, path: str = "<test>") -> list[Unseeded]:
    """The sampled requests in `source` that name no seed."""
    tree = ast.parse(source)
    lines = source.splitlines()
    constants = _constants(tree)
    bound = _bound_names(tree)
    seeded_in: dict[int, set[str]] = {}
    found: list[Unseeded] = []
    inside_calls: set[int] = set()  # dict literals judged with the call they are passed to

    def seeded_later(node: ast.AST) -> bool:
        if id(node) not in bound:
            return False
        name, scope = bound[id(node)]
        if id(scope) not in seeded_in:
            seeded_in[id(scope)] = _seeded_names(scope)
        return name in seeded_in[id(scope)]

    def judge(
        node: ast.AST, fields: dict[str, ast.expr], spread: bool, default: float | None, at: int
    ) -> None:
        if spread or seeded_later(node):
            return
        if "temperature" in fields:
            node = fields["temperature"]
            temperature, at = _number(node, constants), node.lineno
        else:
            temperature = default
        if temperature is None or not 0 < temperature <= 2:
            return
        seed = fields.get("seed")
        if seed is not None and not (isinstance(seed, ast.Constant) and seed.value is None):
            return
        if MARK in lines[at - 1]:
            return
        found.append(Unseeded(path, at, temperature))

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    for call in calls:
        fields: dict[str, ast.expr] = {}
        spread = False
        for keyword in call.keywords:
            if keyword.arg is None:
                spread = True
                continue
            fields[keyword.arg] = keyword.value
            if isinstance(keyword.value, ast.Dict):
                inner, inner_spread = _dict_fields(keyword.value)
                fields |= {k: v for k, v in inner.items() if k not in fields}
                spread |= inner_spread
                inside_calls.add(id(keyword.value))
        default = None
        name = _callee(call)
        if name in SAMPLERS:
            default = SAMPLERS[name]
            if call.args and "temperature" not in fields:
                fields["temperature"] = call.args[0]
            spread |= any(isinstance(a, ast.Starred) for a in call.args)
        judge(call, fields, spread, default, call.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and id(node) not in inside_calls:
            fields, spread = _dict_fields(node)
            judge(node, fields, spread, None, node.lineno)
    return sorted(found, key=lambda item: item.line)


def test_every_sampled_request_in_the_tests_has_a_seed() -> None:
    found = [
        item
        for path in sorted(TESTS.rglob("*.py"))
        for item in unseeded(path.read_text(), str(path.relative_to(TESTS.parent)))
    ]
    assert not found, "sampled without a seed:\n" + "\n".join(map(str, found))


def test_the_check_finds_what_it_should_and_nothing_else() -> None:
    source = """
HOT = 0.7
COLD = 0
SAMPLING = {"temperature": 1.0, "seed": 7}
a = {"messages": [], "temperature": 1.0}                      # 5: unseeded
b = {"messages": [], "temperature": 1.0, "seed": 3}
c = {"messages": [], "temperature": 0}
d = {"messages": [], "temperature": 5}                        # out of range: a 400 test
e = {"messages": [], "temperature": "hot"}
f = {"messages": [], "temperature": HOT}                      # 10: unseeded
g = {"messages": [], "temperature": COLD}
h = {"messages": [], **SAMPLING}
i = client.create(model="m", temperature=1.0, max_tokens=2)  # 13: unseeded
j = client.create(model="m", temperature=1.0, seed=1)
k = client.create(model="m", extra_body={"temperature": 1.0}, seed=1)
l = client.create(model="m", extra_body={"temperature": 1.0})  # 16: unseeded
m = client.create(temperature=1.0, **extra)
n = SamplingParams(max_tokens=4)                              # 18: unseeded (default temperature)
o = SamplingParams(temperature=0.0, max_tokens=4)
p = SamplingParams(1.0, max_tokens=4)                         # 20: unseeded
q = SamplingParams(1.0, seed=2)
r = Sampling(top_p=0.5)                                       # 22: unseeded
s = {"messages": [], "temperature": 1.0, "seed": None}        # 23: unseeded
t = {"messages": [], "temperature": 1.0}  # unseeded: the draw is what is tested
u = forced(server, choice, temperature=temperature)
v = {"temperature": 2.5, "seed": None}


def seeded_later():
    kwargs = dict(model="m", temperature=1.0)
    client.create(**kwargs, seed=1)
    body = {"temperature": 1.0}
    body["seed"] = 2
    more = {"temperature": 1.0}
    more.update(seed=3)
    last = {"temperature": 1.0}
    post(json={**last, "seed": 4})


def not_seeded():
    kwargs = dict(model="m", temperature=1.0)                # 41: unseeded
    client.create(**kwargs)
    body = {"temperature": 1.0}                              # 43: unseeded
    other["seed"] = 2
"""
    assert [(u.line, u.temperature) for u in unseeded(source)] == [
        (5, 1.0),
        (10, 0.7),
        (13, 1.0),
        (16, 1.0),
        (18, 1.0),
        (20, 1.0),
        (22, 1.0),
        (23, 1.0),
        (41, 1.0),
        (43, 1.0),
    ]
