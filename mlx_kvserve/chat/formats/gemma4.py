"""Gemma 4's tool calls (mlx-lm's `gemma4` parser): their grammar and streaming.

Gemma 4 writes each call in its own block, its arguments in its own JSON-like syntax:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,hours:[1,2]}<tool_call|>

Keys are bare words, strings sit between `<|"|>` delimiters (raw text, no escapes), objects
nest with bare keys, arrays and numbers are JSON's without spaces. mlx-lm's parser quotes the
keys and strings and reads the rest as JSON. The grammar makes the model write what that parser
reads back as schema-valid arguments, in the form the Gemma 4 template renders history in (so a
tool loop re-renders what the model sampled): a declared function's name, its declared
parameters sorted by name (the template's `dictsort`) and joined by `,`, the required ones
present; each value typed by its property's schema, recursively for objects and arrays (a
string within its minLength/maxLength or one of its enum values, a number by its own JSON
Schema); a property without a type the grammar follows (a list of types, `anyOf`, a `$ref`) is
any value in the format's syntax. Consecutive calls are consecutive blocks, nothing between.
"""

from __future__ import annotations

import json
import re

from mlx_lm.tool_parsers.gemma4 import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.call_syntax import Marker, Parameters, ParseToolCall
from mlx_kvserve.chat.formats.keyword_calls import KeywordShape, KeywordStream, separated
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

QUOTE = '<|"|>'
_WORD = re.compile(r"[A-Za-z0-9_]+")  # what the parser reads as a bare key (and a name)
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"
GEMMA4_SHAPE = KeywordShape(
    opener=":",
    args_open="{",
    assign=":",
    args_close="}",
    quotes=(QUOTE,),
    escapes=False,
    wrap=lambda name, key, value: f"call:{name}{{{key}:{value}}}",
)


class Gemma4Syntax:
    """The CallSyntax of mlx-lm's `gemma4` format."""

    format = "gemma4"
    lead = ""
    calls_per_block = False
    between = ""  # the template writes consecutive calls with nothing between them

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        g = _Rules(marker, style)
        names = []
        for k, tool in enumerate(tools):
            if not _WORD.fullmatch(tool.name):
                continue  # the parser could not read this name back: the model cannot call it
            args = g.object(f"f{k}", parameters(tool), top=True)
            if args is None:
                continue  # a required parameter it cannot name
            names.append(f"fn_{k}")
            g.rules.append(f"fn_{k}: {json.dumps('call:' + tool.name)} {args}")
        if not names:
            raise InvalidRequest(
                "Invalid value for 'tools': this model writes a tool's name (and each required "
                "parameter's) bare in its calls, so it needs letters, digits or `_` only.",
                param="tools",
            )
        return "\n".join([f"call_body: ({' | '.join(names)}) {marker(end)}", *g.finish()])

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> KeywordStream:
        return KeywordStream(parse, tools, GEMMA4_SHAPE)


class _Rules:
    """Lark rules for values in Gemma 4's syntax, typed by JSON Schemas."""

    def __init__(self, marker: Marker, style: dict[str, JSON]) -> None:
        self.rules: list[str] = []
        self._marker, self._style = marker, style
        self._quote = marker(QUOTE)
        self._count = 0
        self._any = False

    def _name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}{self._count}"

    def finish(self) -> list[str]:
        if self._any:
            self.rules += [
                f'g_any: {self.string(None, None)} | {_NUMBER} | "true" | "false" | "null"'
                ' | "{" (g_pair ("," g_pair)*)? "}" | "[" (g_any ("," g_any)*)? "]"',
                'g_pair: /[A-Za-z0-9_]+/ ":" g_any',
            ]
        return self.rules

    def any(self) -> str:
        self._any = True
        return "g_any"

    def string(self, low: JSON, high: JSON) -> str:
        """A delimited raw string: it cannot hold the delimiter. When the delimiter is text,
        the string and its closing delimiter are one lexeme (the first delimiter ends it)."""
        low = low if isinstance(low, int) and low >= 0 else 0
        high = high if isinstance(high, int) and high >= low else None
        span = f"{{{low},{'' if high is None else high}}}"
        body = f'/(?s:.{span})/ & ~/(?s:.*<\\|"\\|>.*)/'
        terminal = self._name("G_STR").upper()
        if self._quote.startswith("<["):
            self.rules.append(f"{terminal}: {body}")
            return f"{self._quote} {terminal} {self._quote}"
        self.rules.append(f"{terminal}: ({body}) {json.dumps(QUOTE)}")
        return f"{self._quote} {terminal}"

    def value(self, prop: JSON) -> str:
        if not isinstance(prop, dict):
            return self.any()
        kind = prop.get("type")
        options = prop.get("enum")
        if "const" in prop:
            options = [prop["const"]]
        if kind == "string":
            if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
                plain = [o for o in options if QUOTE not in o]
                if plain:
                    quoted = (f"{self._quote} {json.dumps(o)} {self._quote}" for o in plain)
                    return f"({' | '.join(quoted)})"
            return self.string(prop.get("minLength"), prop.get("maxLength"))
        if kind in ("integer", "number"):  # (a list of types is not hashable)
            return f"%json {json.dumps({**prop, 'x-guidance': self._style})}"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self.array(prop)
        if kind == "object" and isinstance(prop.get("properties"), dict):
            return self.object(self._name("o"), prop) or self.any()
        return self.any()

    def array(self, prop: dict[str, JSON]) -> str:
        low, high = prop.get("minItems"), prop.get("maxItems")
        low = low if isinstance(low, int) and low >= 0 else 0
        high = high if isinstance(high, int) and high >= low else None
        if high == 0:
            return '"[]"'
        item = self._name("item")
        self.rules.append(f"{item}: {self.value(prop.get('items'))}")
        rest = f"{{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        items = f'{item} ("," {item}){rest}'
        return f'"[" {items} "]"' if low > 0 else f'"[" ({items})? "]"'

    def object(self, prefix: str, schema: dict[str, JSON], top: bool = False) -> str | None:
        """`{key:value,...}`, keys sorted as the template's `dictsort` has them; None when a
        required key cannot be written bare."""
        props = schema.get("properties")
        if not isinstance(props, dict):
            return '"{}"' if top else self.any()
        required = set(schema.get("required") or [])
        items = []
        for key in sorted((k for k in props if isinstance(k, str)), key=str.lower):
            if not _WORD.fullmatch(key):
                if key in required:
                    return None
                continue
            rule = self._name(f"{prefix}_p")
            self.rules.append(f"{rule}: {json.dumps(key + ':')} {self.value(props[key])}")
            items.append((rule, key in required))
        listed = separated(self._name(prefix), items, '","', self.rules)
        return f'"{{" {listed} "}}"'


syntax = Gemma4Syntax()
FORMAT = ToolFormat("gemma4", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "gemma4" else None
