"""The Go-template subset Ollama's clients send as `/api/generate`'s `template`.

Ollama's older model templates, and what clients pass to override one, read `{{ .System }}`,
`{{ .Prompt }}`, `{{ .Response }}` (and `{{ .Suffix }}` for fill-in-the-middle) with
`{{ if .X }}...{{ else }}...{{ end }}` around them and `{{-`/`-}}` trimming the space beside
an action. That is what this renders; anything else (`range`, pipelines, functions, `.Messages`)
is a `TemplateError`, which the route answers with a 400 naming `template`.

As Ollama's `Template.Execute` does for a legacy template, the text stops where `.Response`
would be written: the prompt ends where the model's answer begins.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

FIELDS = ("System", "Prompt", "Response", "Suffix")
_ACTION = re.compile(r"\{\{(- )?(.*?)( -)?\}\}", re.DOTALL)
_FIELD = re.compile(r"\.(\w+)")


class TemplateError(ValueError):
    """A template outside the subset, or malformed."""


@dataclass
class _If:
    name: str
    chained: bool = False  # an `else if`: the `end` of the `if` it continues closes it too
    then: list[_Node] = field(default_factory=list)
    otherwise: list[_Node] = field(default_factory=list)


@dataclass(frozen=True)
class _Field:
    name: str


_Node = str | _Field | _If


class _Cut(Exception):
    """`.Response` reached: the prompt ends here."""


def render(template: str, values: dict[str, str]) -> str:
    """`template` with `values` (keys from FIELDS; a missing one is empty), cut before the
    first `.Response`."""
    out: list[str] = []
    with contextlib.suppress(_Cut):
        _emit(_parse(template), values, out)
    return "".join(out)


def _emit(nodes: list[_Node], values: dict[str, str], out: list[str]) -> None:
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, _Field):
            if node.name == "Response":
                raise _Cut
            out.append(values.get(node.name, ""))
        else:
            chosen = node.then if values.get(node.name) else node.otherwise
            _emit(chosen, values, out)


def _parse(template: str) -> list[_Node]:
    """The template's tree: text, fields and `if` blocks."""
    root: list[_Node] = []
    stack: list[tuple[_If, bool]] = []  # open blocks, and whether in their `else` part
    target = root
    position = 0
    trim_next = False
    for match in _ACTION.finditer(template):
        text = template[position : match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        if text:
            target.append(text)
        position = match.end()
        trim_next = bool(match.group(3))
        action = match.group(2).strip()
        if action.startswith("/*") and action.endswith("*/"):
            continue
        words = action.split()
        if len(words) == 1 and _is_field(words[0]):
            target.append(_Field(_name(words[0])))
        elif len(words) == 2 and words[0] == "if" and _is_field(words[1]):
            block = _If(_name(words[1]))
            target.append(block)
            stack.append((block, False))
            target = block.then
        elif words == ["else"] and stack and not stack[-1][1]:
            block, _ = stack.pop()
            stack.append((block, True))
            target = block.otherwise
        elif len(words) == 3 and words[:2] == ["else", "if"] and stack and not stack[-1][1]:
            block, _ = stack.pop()
            name = _name(words[2]) if _is_field(words[2]) else _unsupported(action)
            inner = _If(name, chained=True)
            block.otherwise.append(inner)
            stack.append((block, True))
            stack.append((inner, False))
            target = inner.then
        elif words == ["end"] and stack:
            while stack.pop()[0].chained:
                pass
            target = _innermost(stack, root)
        else:
            _unsupported(action)
    if stack:
        raise TemplateError("an `if` without its `{{ end }}`")
    text = template[position:]
    if trim_next:
        text = text.lstrip()
    if text:
        target.append(text)
    if "{{" in text:
        raise TemplateError("an unclosed action (`{{` without `}}`)")
    return root


def _innermost(stack: list[tuple[_If, bool]], root: list[_Node]) -> list[_Node]:
    if not stack:
        return root
    block, in_else = stack[-1]
    return block.otherwise if in_else else block.then


def _is_field(word: str) -> bool:
    match = _FIELD.fullmatch(word)
    return match is not None and match.group(1) in FIELDS


def _name(word: str) -> str:
    return word[1:]


def _unsupported(action: str) -> str:
    shown = action if len(action) <= 40 else action[:37] + "..."
    raise TemplateError(
        f"{{{{ {shown} }}}} is not supported: a template may use "
        f"{', '.join('.' + f for f in FIELDS)}, `if`, `else` and `end`"
    )
