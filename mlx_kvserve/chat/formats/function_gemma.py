"""FunctionGemma's tool calls (mlx-lm's `function_gemma` parser): their grammar and streaming.

    <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>

Gemma 4's layout with `<escape>` around strings, read by a simpler parser: it takes the
arguments up to the first `}` and splits the values that are not strings at each `,`, so only
flat values come back whole: strings (raw text between `<escape>`s, without `}`), numbers,
booleans and null. The grammar makes the model write those only, keyed by bare words sorted by
name (as `dictsort` orders them); a parameter of another type is left out when optional, and a
tool that requires one cannot be called in this format. One call per block; consecutive calls
are consecutive blocks.
"""

from __future__ import annotations

import json
import re

from mlx_lm.tool_parsers.function_gemma import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.call_syntax import Marker, Parameters, ParseToolCall
from mlx_kvserve.chat.formats.keyword_calls import KeywordShape, KeywordStream, separated
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

QUOTE = "<escape>"
_WORD = re.compile(r"[A-Za-z0-9_]+")  # what the parser reads as a name (`\w+`) and a key
_FLAT = ("string", "integer", "number", "boolean", "null")
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"
SHAPE = KeywordShape(
    opener=":",
    args_open="{",
    assign=":",
    args_close="}",
    quotes=(QUOTE,),
    escapes=False,
    wrap=lambda name, key, value: f"call:{name}{{{key}:{value}}}",
)


class FunctionGemmaSyntax:
    """The CallSyntax of mlx-lm's `function_gemma` format."""

    format = "function_gemma"
    lead = ""
    calls_per_block = False
    between = ""

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        rules: list[str] = []
        values = _FlatValues(marker, style, rules)
        names = []
        for k, tool in enumerate(tools):
            if not _WORD.fullmatch(tool.name):
                continue  # the parser could not read this name back: the model cannot call it
            args = values.arguments(f"f{k}", parameters(tool))
            if args is None:
                continue  # a required parameter it cannot write
            names.append(f"fn_{k}")
            rules.append(f"fn_{k}: {json.dumps('call:' + tool.name)} {args}")
        if not names:
            raise InvalidRequest(
                "Invalid value for 'tools': this model writes a tool's name and its parameters' "
                "names bare, and only strings, numbers, booleans and null as values, so a tool "
                "needs a name of letters, digits or `_` and no required parameter of another "
                "kind.",
                param="tools",
            )
        return "\n".join([f"call_body: ({' | '.join(names)}) {marker(end)}", *rules])

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> KeywordStream:
        return KeywordStream(parse, tools, SHAPE)


class _FlatValues:
    """Lark items for the flat values the parser reads back, typed by JSON Schemas."""

    def __init__(self, marker: Marker, style: dict[str, JSON], rules: list[str]) -> None:
        self._quote = marker(QUOTE)
        self._style, self.rules = style, rules
        self._count = 0

    def _name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}{self._count}"

    def arguments(self, prefix: str, schema: dict[str, JSON]) -> str | None:
        """`{key:value,...}`, keys sorted; None when a required key cannot be written."""
        props = schema.get("properties")
        if not isinstance(props, dict):
            return '"{}"'
        required = set(schema.get("required") or [])
        items = []
        for key in sorted((k for k in props if isinstance(k, str)), key=str.lower):
            value = self.value(props[key]) if _WORD.fullmatch(key) else None
            if value is None:
                if key in required:
                    return None
                continue
            rule = self._name(f"{prefix}_p")
            self.rules.append(f"{rule}: {json.dumps(key + ':')} {value}")
            items.append((rule, key in required))
        listed = separated(self._name(prefix), items, '","', self.rules)
        return f'"{{" {listed} "}}"'

    def value(self, prop: JSON) -> str | None:
        """A value typed by `prop`; None when the parser could not read it back whole."""
        if not isinstance(prop, dict):
            return None
        options = [prop["const"]] if "const" in prop else prop.get("enum")
        if isinstance(options, list) and options:
            written = [self._option(o) for o in options]
            return f"({' | '.join(w for w in written if w)})" if any(written) else None
        kind = prop.get("type")
        if kind == "string":
            return self.string(prop.get("minLength"), prop.get("maxLength"))
        if kind in ("integer", "number"):
            return f"%json {json.dumps({**prop, 'x-guidance': self._style})}"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind is None or (isinstance(kind, list) and all(k in _FLAT for k in kind)):
            # no type, or flat ones only: any flat value
            return f'({self.string(None, None)} | {_NUMBER} | "true" | "false" | "null")'
        return None

    def _option(self, option: JSON) -> str | None:
        """One enum or const value as written (strings raw, others as JSON); None if unwritable."""
        if isinstance(option, str):
            if QUOTE in option or "}" in option:
                return None
            return f"{self._quote} {json.dumps(option)} {self._quote}"
        if option is None or isinstance(option, bool | int | float):
            return json.dumps(json.dumps(option))
        return None

    def string(self, low: JSON, high: JSON) -> str:
        """Raw text between delimiters, without the delimiter or `}` (the parser's end)."""
        low = low if isinstance(low, int) and low >= 0 else 0
        high = high if isinstance(high, int) and high >= low else None
        span = f"{{{low},{'' if high is None else high}}}"
        body = f"/(?s:.{span})/ & ~/(?s:.*(<escape>|\\}}).*)/"
        terminal = self._name("FG_STR")
        if self._quote.startswith("<["):
            self.rules.append(f"{terminal}: {body}")
            return f"{self._quote} {terminal} {self._quote}"
        self.rules.append(f"{terminal}: ({body}) {json.dumps(QUOTE)}")
        return f"{self._quote} {terminal}"


syntax = FunctionGemmaSyntax()
FORMAT = ToolFormat("function_gemma", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "function_gemma" else None
