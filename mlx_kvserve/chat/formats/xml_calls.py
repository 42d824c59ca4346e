"""Tool calls with one tag per parameter: the grammar and streaming that the `Layout`s of
chat.formats.qwen3_coder, glm47, minimax_m2, longcat and minicpm5 share.

Qwen3-Coder and Qwen3.5/3.6 write a call as

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

and GLM-4.5/4.6 (mlx-lm's `glm47` parser) as

    <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>

Each format's mlx-lm parser converts a VALUE by the type its property declares
(a string stays raw text, others are read as JSON). The grammar makes the model write what that
parser reads back as schema-valid arguments, in the layout the model's template renders history
in (so a tool loop re-renders what the model sampled): the function name is one of the declared
tools; the parameters are the declared properties in schema order, the required ones present and
each at most once; a string value is raw text that holds no closing tag (within its
minLength/maxLength, or one of its enum values); other values are JSON following the property's
own schema, in the canonical form (`", "` and `": "`) the templates' `tojson` writes. A property
whose type the parser cannot convert faithfully (a list of types, no type) is free text, as LM
Studio's grammar for the Qwen format has it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mlx_kvserve.chat.call_syntax import (
    CallPiece,
    Marker,
    Parameters,
    ParseToolCall,
    callable_tools,
)
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.json_value import JSON

_KEY = re.compile(r"[^\s<>]+")  # what the parsers read as a name
STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_BOOL_TYPES = {"boolean", "bool", "binary"}
_JSON_PREFIXES = ("int", "uint", "long", "short", "unsigned", "num", "float", "dict", "list")

# why a request none of whose tools this format can call is refused
_UNCALLABLE = (
    "this model writes a tool's name in its calls, so a name needs at least one character "
    "and no spaces, `<` or `>`."
)


@dataclass(frozen=True)
class Layout:
    """Where one format puts a call's name and parameters (after the opening marker)."""

    format: str
    lead: str  # before a forced call's opening marker (the template's, so history re-renders)
    head: str  # before the name, and after it
    head_end: str
    key_open: str  # before a parameter's name, and between it and its value
    key_close: str
    value_close: str  # the tag that ends a value, and what follows it
    value_after: str
    tail: str  # after the last parameter, before the closing marker
    strict_strings: bool  # the parser maps "null" to None and keeps whitespace
    string_types: frozenset[str]
    stops: tuple[str, ...] = ("</tool_call>",)  # tags a raw value may not hold, beyond its own
    null_is_none: bool = False  # a stripping parser that still reads "null" as None (MiniMax)

    calls_per_block = False  # one call per <tool_call> block

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        """The `call_body` rule of this layout (a CallSyntax)."""
        return calls_rule(self, tools, parameters, style, marker, end)

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> XmlCallStream:
        return XmlCallStream(self, parse, tools)

    def wrap(self, name: str, params: str) -> str:
        """A whole call's text (without markers) for the format's parser."""
        return f"{self.head}{name}{self.head_end}{params}{self.tail}"

    def kind(self, prop: dict[str, JSON]) -> str:
        """How the parser converts a value of this property: "string" (raw text), "bool",
        "null", "json" (a JSON literal), or "free" (text it may reinterpret)."""
        if not prop or "type" not in prop:
            return "free"
        kind = str(prop["type"]).strip().lower()
        if kind in self.string_types:
            return "string"
        if kind in _BOOL_TYPES:
            return "bool"
        if kind == "null":
            return "null"
        if kind in {"object", "array", "arr", "integer", "number"} or kind.startswith(
            _JSON_PREFIXES
        ):
            return "json"
        return "free"


_TAG = re.compile(r"(</?[A-Za-z_]+>)")


def calls_rule(
    layout: Layout,
    tools: list[Tool],
    parameters: Parameters,
    style: dict[str, JSON],
    marker: Marker,
    end: str,
) -> str:
    """Lark rules `call_body` (what follows `<tool_call>`) for calls to `tools`;
    `parameters(tool)` is a tool's JSON Schema, `marker(tag)` a tag's Lark item (GLM's
    `<arg_key>` is one token in its tokenizer), `end` the closing marker."""
    names, rules = [], []
    g = _Items(layout, marker)
    for k, tool in callable_tools(tools, lambda name: _KEY.fullmatch(name), _UNCALLABLE):
        head = g.items(layout.head + tool.name + layout.head_end)
        params = _params_rules(g, f"f{k}", parameters(tool), style, rules)
        names.append(f"fn_{k}")
        rules.append(f"fn_{k}: {head} {params} {g.items(layout.tail)} {marker(end)}")
    return "\n".join([f"call_body: {' | '.join(names)}", *rules])


class _Items:
    """Lark items for one format's fixed text, with its tags as tokens where they are."""

    def __init__(self, layout: Layout, marker: Marker) -> None:
        self.layout, self._marker = layout, marker

    def items(self, text: str) -> str:
        parts = [p for p in _TAG.split(text) if p]
        # literally: Lark reads an escaped astral character as two lone surrogates
        out = [
            self._marker(p) if _TAG.fullmatch(p) else json.dumps(p, ensure_ascii=False)
            for p in parts
        ]
        return " ".join(out) or '""'

    def close(self) -> str:
        return self.items(self.layout.value_close + self.layout.value_after)

    def closing_is_token(self) -> bool:
        tag = self.layout.value_close.strip()
        return self._marker(tag).startswith("<[")

    def text(self, rules: list[str], terminal: str, low: JSON, high: JSON) -> str:
        """Raw text and the closing tag. As text, they are one lexeme: the value cannot hold
        the tag, so the first one ends it (a greedy lexer needs no lookahead). A closing tag
        that is a token ends the text by itself."""
        if not self.closing_is_token():
            rules.append(f"{terminal}: {_text(self.layout, low, high)}")
            return terminal
        low = low if isinstance(low, int) and low >= 0 else 0
        high = high if isinstance(high, int) and high >= low else None
        span = f"{{{max(low, 1)},{'' if high is None else high}}}"
        rules.append(f"{terminal}: /(?s:.{span})/ & {_exclusions(self.layout)}")
        value = terminal if low > 0 else f"{terminal}?"
        return f"{value} {self.close()}"


def _params_rules(
    g: _Items, prefix: str, schema: dict[str, JSON], style: dict, rules: list[str]
) -> str:
    """The parameters of one function as a Lark expression (rules appended to `rules`)."""
    layout = g.layout
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        if schema.get("additionalProperties") is False:
            return '""'
        value = g.text(rules, f"{prefix.upper()}_TEXT", None, None)
        rules.append(f"{prefix.upper()}_KEY: /[^\\s<>]+/")
        key = f"{g.items(layout.key_open)} {prefix.upper()}_KEY {g.items(layout.key_close)}"
        rules.append(f"{prefix}_free: {key} {value}")
        return f"{prefix}_free*"
    required = set(schema.get("required") or [])
    # a property's own schema may point into the tool's definitions: they go with it
    shared = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    shared["x-guidance"] = style
    parts = []
    for j, (key, prop) in enumerate(props.items()):
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            continue  # the parser could not read this name back: leave it out
        rule = f"{prefix}_p{j}"
        prop = prop if isinstance(prop, dict) else {}
        value = _value(g, f"{prefix.upper()}_V{j}", prop, shared, rules)
        rules.append(f"{rule}: {g.items(layout.key_open + key + layout.key_close)} {value}")
        parts.append(rule if key in required else f"{rule}?")
    return " ".join(parts) or '""'


def _value(g: _Items, terminal: str, prop: dict[str, JSON], shared: dict, rules: list[str]) -> str:
    """A parameter's value and its closing tag, as a Lark expression (raw text becomes the
    terminal `terminal`, defined in `rules`)."""
    layout = g.layout
    close = g.close()
    kind = layout.kind(prop)
    if kind == "bool":
        return f'("true" | "false") {close}'
    if kind == "null":
        return f'"null" {close}'
    if kind == "json":
        return f"%json {json.dumps({**prop, **shared})} {close}"
    options = prop.get("enum") if kind == "string" else None
    if "const" in prop and kind == "string":
        options = [prop["const"]]
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        allowed = [o for o in options if _plain(layout, o)]
        if allowed:
            return f"({' | '.join(json.dumps(o) for o in allowed)}) {close}"
    low, high = (prop.get("minLength"), prop.get("maxLength")) if kind == "string" else (0, None)
    return g.text(rules, terminal, low, high)


def _plain(layout: Layout, value: str) -> bool:
    """The parser reads this raw string back unchanged."""
    if "</" in value:
        return False
    if (layout.strict_strings or layout.null_is_none) and value.lower() == "null":
        return False
    return layout.strict_strings or value == value.strip()


def _text(layout: Layout, low: JSON, high: JSON) -> str:
    """Raw text and the closing tag as one lexeme."""
    low = low if isinstance(low, int) and low >= 0 else 0
    high = high if isinstance(high, int) and high >= low else None
    span = f"{{{low},{'' if high is None else high}}}"
    closing = json.dumps(layout.value_close + layout.value_after)
    return f"(/(?s:.{span})/ & {_exclusions(layout)}) {closing}"


def _exclusions(layout: Layout) -> str:
    """What a raw value may not be: hold a closing tag, or be what the parser reads otherwise."""
    tags = [layout.value_close.strip(), *layout.stops]
    alternatives = "|".join(re.escape(t).replace("/", "\\/") for t in tags)
    bad = f"~/(?s:.*)({alternatives})(?s:.*)/"
    if layout.strict_strings:
        return f"{bad} & ~/(?i:null)/"
    bad += " & ~/(?i:null)/" if layout.null_is_none else ""
    return f"{bad} & ~/(?s:\\s.*)/ & ~/(?s:.*\\s)/"  # the parser strips the value's ends


class XmlCallStream:
    """Follows one call's text as it grows: its name once complete, and its arguments as
    OpenAI-shaped JSON fragments, `{"key": ` when a parameter opens and the value's JSON when it
    closes (converted by the format's own parser, from the parameter's own text). The
    fragments, plus the closing `}`, concatenate to `json.dumps` of the parsed arguments."""

    def __init__(
        self, layout: Layout, parse: ParseToolCall, tools: list[dict[str, JSON]] | None
    ) -> None:
        self._layout, self._parse, self._tools = layout, parse, tools
        # a name with nothing after it is complete only at the next tag
        ends = re.escape(layout.head_end) if layout.head_end else "(?=<)"
        self._head = re.compile(r"\s*" + re.escape(layout.head.strip()) + r"([^\s<>]+)" + ends)
        self._key = re.compile(
            re.escape(layout.key_open) + r"([^\s<>]+)" + re.escape(layout.key_close)
        )
        self.name: str | None = None
        self.sent = ""  # the argument fragments passed on so far
        self._at = 0  # where the next parameter may start in the call's text
        self._open: tuple[str, int] | None = None  # the parameter being written, and its start

    def feed(self, text: str) -> list[CallPiece]:
        """The name once complete, then new argument fragments, given the whole call text so
        far (after `<tool_call>`)."""
        named: list[CallPiece] = []
        if self.name is None:
            head = self._head.match(text)
            if head is None:
                return named
            self.name, self._at = head.group(1), head.end()
            named.append(CallPiece(0, self.name))
        return named + [CallPiece(0, fragment=f) for f in self._fragments(text)]

    def _fragments(self, text: str) -> list[str]:
        out: list[str] = []
        close = self._layout.value_close.strip()
        while True:
            if self._open is None:
                match = self._key.search(text, self._at)
                if match is None:
                    return out
                self._open, self._at = (match.group(1), match.start()), match.end()
                out.append(("{" if not self.sent else ", ") + json.dumps(match.group(1)) + ": ")
            else:
                end = text.find(close, self._at)
                if end < 0:
                    return out
                key, start = self._open
                value = self._convert(key, text[start : end + len(close)])
                out.append(json.dumps(value, ensure_ascii=False))
                self._open, self._at = None, end + len(close)
            self.sent += out[-1]

    def _convert(self, key: str, param: str) -> JSON:
        assert self.name is not None
        try:
            parsed = self._parse(self._layout.wrap(self.name, param), self._tools)
            return parsed["arguments"][key]
        except Exception:  # a value the parser cannot convert (e.g. "1.5" for an integer)
            return param

    def finish(self, slot: int, arguments: JSON) -> tuple[str, str]:
        """(the last fragment, the call's whole arguments text) for the parsed arguments (None:
        the call did not parse, e.g. cut short by max_tokens: it is what was streamed)."""
        if arguments is None:
            return "", self.sent
        whole = json.dumps(arguments if isinstance(arguments, dict) else {}, ensure_ascii=False)
        if whole.startswith(self.sent):
            return whole[len(self.sent) :], whole
        return "", whole  # unconstrained text the parser read otherwise than streamed
