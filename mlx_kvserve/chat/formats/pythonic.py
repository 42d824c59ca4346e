"""Pythonic tool calls (mlx-lm's `pythonic` parser; LFM2/LFM2.5): their grammar and streaming.

LFM2 writes every call of a turn in one block, as a Python list of calls with keyword arguments:

    <|tool_call_start|>[get_weather(city='Paris', days=3), ping()]<|tool_call_end|>

mlx-lm's parser reads the list with `ast` (`true`/`false`/`null` become Python's). The grammar
makes the model write what that parser reads back as schema-valid arguments, in the form the
LFM2 template renders history in (so a tool loop re-renders what the model sampled): a declared
function's name, its declared parameters in schema order joined by `", "`, the required ones
present; a string is `'...'` (the template quotes it so, unescaped: the text holds no quote,
backslash or line break), within its minLength/maxLength or one of its enum values; a boolean
`True`/`False`, null `None`; any other value JSON by its own schema (the template writes an
object with `tojson`; a number or array JSON writes is a Python literal too). A string with a
`pattern` or `format` is a JSON string, which Python reads the same.
"""

from __future__ import annotations

import json
import keyword

from mlx_lm.tool_parsers.pythonic import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.call_syntax import Marker, Parameters, ParseToolCall
from mlx_kvserve.chat.formats.keyword_calls import KeywordShape, KeywordStream, separated
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

_BAD_CHARS = "'\\\n\r"
# `[name(key=value, ...), ...]`: a value's end is the next top-level `,` or `)`
PYTHONIC_SHAPE = KeywordShape(
    opener="[",
    args_open="(",
    assign="=",
    args_close=")",
    quotes=("'", '"'),
    escapes=True,
    wrap=lambda name, key, value: f"[{name}({key}={value})]",
)


def _identifier(name: str) -> bool:
    return name.isascii() and name.isidentifier() and not keyword.iskeyword(name)


def callable_name(name: str) -> bool:
    """The parser reads this back as the function's name (dotted names are attributes)."""
    return all(_identifier(part) for part in name.split("."))


class PythonicSyntax:
    """The CallSyntax of mlx-lm's `pythonic` format."""

    format = "pythonic"
    lead = ""
    calls_per_block = True

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int,
    ) -> str:
        names, rules = [], []
        for k, tool in enumerate(tools):
            if not callable_name(tool.name):
                continue  # the parser could not read this name back: the model cannot call it
            args = _arguments(f"f{k}", parameters(tool), style, rules)
            if args is None:
                continue  # a required parameter it cannot name
            names.append(f"fn_{k}")
            rules.append(f'fn_{k}: {json.dumps(tool.name + "(")} {args} ")"')
        if not names:
            raise InvalidRequest(
                "Invalid value for 'tools': this model writes its calls as Python, so a tool's "
                "name (and each required parameter's) must be a Python identifier.",
                param="tools",
            )
        more = f' (", " one_call){{0,{most - 1}}}' if most > 1 else ""
        return "\n".join(
            [
                f'call_body: "[" one_call{more} "]" {marker(end)}',
                f"one_call: {' | '.join(names)}",
                *rules,
            ]
        )

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> KeywordStream:
        return KeywordStream(parse, tools, PYTHONIC_SHAPE)


def _arguments(prefix: str, schema: dict[str, JSON], style: dict, rules: list[str]) -> str | None:
    """The keyword arguments of one function as a Lark expression; None when a required
    parameter's name is no Python identifier."""
    props = schema.get("properties")
    if not isinstance(props, dict):
        return '""'
    required = set(schema.get("required") or [])
    shared = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    shared["x-guidance"] = style
    items = []
    for j, (key, prop) in enumerate(props.items()):
        if not isinstance(key, str) or not _identifier(key):
            if key in required:
                return None
            continue
        prop = prop if isinstance(prop, dict) else {}
        value = _value(f"{prefix.upper()}_V{j}", prop, shared, rules)
        rules.append(f"{prefix}_p{j}: {json.dumps(key + '=')} {value}")
        items.append((f"{prefix}_p{j}", key in required))
    return separated(prefix, items, '", "', rules)


def _value(terminal: str, prop: dict[str, JSON], shared: dict, rules: list[str]) -> str:
    """One argument's value as a Lark expression (a raw string becomes `terminal`)."""
    kind = prop.get("type")
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    if kind == "string" and "pattern" not in prop and "format" not in prop:
        options = prop.get("enum")
        if "const" in prop:
            options = [prop["const"]]
        if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
            plain = [o for o in options if not any(c in o for c in _BAD_CHARS)]
            if plain:
                quoted = (json.dumps("'" + o + "'") for o in plain)
                return f"({' | '.join(quoted)})"
            return f"%json {json.dumps({**prop, **shared})}"  # JSON strings Python reads too
        low, high = prop.get("minLength"), prop.get("maxLength")
        low = low if isinstance(low, int) and low >= 0 else 0
        high = high if isinstance(high, int) and high >= low else None
        rules.append(f"{terminal}: /[^'\\\\\\n\\r]{{{low},{'' if high is None else high}}}/")
        return f'"\'" {terminal} "\'"'
    return f"%json {json.dumps({**prop, **shared})}"


syntax = PythonicSyntax()
FORMAT = ToolFormat("pythonic", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "pythonic" else None
