"""Qwen3-Coder's XML tool calls (mlx-lm's `qwen3_coder` parser): their grammar and streaming.

Qwen3-Coder and Qwen3.5/3.6 write a call as

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

and mlx-lm's parser converts each VALUE by the type its property declares (a string stays raw
text, an integer goes through float(), an object through json.loads, "null" is None whatever the
type). The grammar makes the model write what that parser reads back as schema-valid arguments:
the function name is one of the declared tools; the parameters are the declared properties in
schema order, the required ones present and each at most once; a string value is raw text that
holds no `</parameter>` or `</tool_call>` (and is not "null"), within its minLength/maxLength or
one of its enum values; booleans are `true`/`false`; numbers, integers, objects and arrays are
JSON following the property's own schema, in the canonical form (`", "` and `": "`) the Qwen3.5
template's `tojson` renders history in, so a tool loop re-renders what the model sampled.

A property whose type the parser cannot convert faithfully (a list of types, no type) is free
text, as LM Studio's grammar for this format has it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_kvserve.chat.errors import InvalidRequest
from mlx_kvserve.chat.request import Tool

FORMAT = "qwen3_coder"
CLOSE = "\n</parameter>\n"
_KEY = re.compile(r"[^\s<>]+")  # what the parser reads as a name
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_BOOL_TYPES = {"boolean", "bool", "binary"}
_JSON_PREFIXES = ("int", "uint", "long", "short", "unsigned", "num", "float", "dict", "list")
_BAD = r"~/(?s:.*)<\/(parameter|tool_call)>(?s:.*)/"


def calls_rule(tools: list[Tool], parameters: Any, style: dict[str, Any], end: str) -> str:
    """Lark rules `call_body` (what follows `<tool_call>`) for calls to `tools`;
    `parameters(tool)` is a tool's JSON Schema, `end` the closing marker's Lark item."""
    names, rules = [], []
    for k, tool in enumerate(tools):
        if not _KEY.fullmatch(tool.name):
            continue  # the parser could not read this name back: the model cannot call it
        schema = parameters(tool)
        head = json.dumps(f"\n<function={tool.name}>\n")
        params = _params_rules(f"f{k}", schema, style, rules)
        names.append(f"fn_{k}")
        rules.append(f'fn_{k}: {head} {params} "</function>\\n" {end}')
    if not names:
        raise InvalidRequest(
            "Invalid value for 'tools': this model writes a tool's name in its calls as "
            "`<function=NAME>`, so a name needs at least one character and no spaces, `<` or `>`.",
            param="tools",
        )
    return "\n".join([f"call_body: {' | '.join(names)}", *rules])


def _params_rules(prefix: str, schema: dict[str, Any], style: dict, rules: list[str]) -> str:
    """The parameters of one function as a Lark expression (rules appended to `rules`)."""
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        if schema.get("additionalProperties") is False:
            return '""'
        text = f"{prefix.upper()}_TEXT"
        rules.append(f"{text}: {_text(None, None)}")
        rules.append(f"{prefix}_free: /<parameter=[^\\s<>]+>\\n/ {text}")
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
        value = _value(f"{prefix.upper()}_V{j}", prop, shared, rules)
        rules.append(f"{rule}: {json.dumps(f'<parameter={key}>' + chr(10))} {value}")
        parts.append(rule if key in required else f"{rule}?")
    return " ".join(parts) or '""'


def _value(terminal: str, prop: dict[str, Any], shared: dict, rules: list[str]) -> str:
    """A parameter's value and its closing tag, as a Lark expression (raw text becomes the
    terminal `terminal`, defined in `rules`)."""
    kind = value_kind(prop)
    if kind == "bool":
        return f'("true" | "false") {json.dumps(CLOSE)}'
    if kind == "null":
        return f'"null" {json.dumps(CLOSE)}'
    if kind == "json":
        return f"%json {json.dumps({**prop, **shared})} {json.dumps(CLOSE)}"
    options = prop.get("enum") if kind == "string" else None
    if "const" in prop and kind == "string":
        options = [prop["const"]]
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        allowed = [o for o in options if o.lower() != "null" and "</" not in o]
        if allowed:
            return f"({' | '.join(json.dumps(o + CLOSE) for o in allowed)})"
    low, high = (prop.get("minLength"), prop.get("maxLength")) if kind == "string" else (0, None)
    rules.append(f"{terminal}: {_text(low, high)}")
    return terminal


def _text(low: Any, high: Any) -> str:
    """Raw text and the closing tag, as one lexeme: the text cannot hold a closing tag, so the
    first `</parameter>` ends it (a greedy lexer needs no lookahead)."""
    low = low if isinstance(low, int) and low >= 0 else 0
    high = high if isinstance(high, int) and high >= low else None
    span = f"{{{low},{'' if high is None else high}}}"
    return f'(/(?s:.{span})/ & {_BAD} & ~/(?i:null)/) "\\n</parameter>\\n"'


def value_kind(prop: dict[str, Any]) -> str:
    """How mlx-lm's qwen3_coder parser converts a value of this property: "string" (raw text),
    "bool", "null", "json" (a JSON literal), or "free" (text it may reinterpret)."""
    if not prop or "type" not in prop:
        return "free"
    kind = str(prop["type"]).strip().lower()
    if kind in _STRING_TYPES:
        return "string"
    if kind in _BOOL_TYPES:
        return "bool"
    if kind == "null":
        return "null"
    if kind in {"object", "array", "arr", "integer", "number"} or kind.startswith(_JSON_PREFIXES):
        return "json"
    return "free"


class XmlCallStream:
    """Follows one call's text as it grows: its name once `<function=NAME>` is complete, and
    its arguments as OpenAI-shaped JSON fragments, `{"key": ` when a parameter opens and the
    value's JSON when it closes (converted by the format's own parser). The fragments, plus the
    closing `}`, concatenate to `json.dumps` of the parsed arguments."""

    _HEAD = re.compile(r"\s*<function=([^\s<>]+)>\n")
    _PARAM = re.compile(r"<parameter=([^\s<>]+)>\n?")

    def __init__(self, parse: Any, tools: list[dict[str, Any]] | None) -> None:
        self._parse, self._tools = parse, tools
        self.name: str | None = None
        self.sent = ""  # the argument fragments passed on so far
        self._at = 0  # where the next parameter may start in the call's text
        self._open: str | None = None  # the parameter whose value is being written

    def feed(self, text: str) -> list[str]:
        """New argument fragments, given the whole call text so far (after `<tool_call>`)."""
        out: list[str] = []
        if self.name is None:
            head = self._HEAD.match(text)
            if head is None:
                return out
            self.name, self._at = head.group(1), head.end()
        while True:
            if self._open is None:
                at = text.find("<parameter=", self._at)
                match = self._PARAM.match(text, at) if at >= 0 else None
                if match is None or (match.end() == len(text) and not text.endswith("\n")):
                    return out
                self._open, self._at = match.group(1), match.end()
                out.append(("{" if not self.sent else ", ") + json.dumps(self._open) + ": ")
            else:
                end = text.find("</parameter>", self._at)
                if end < 0:
                    return out
                value = self._convert(self._open, text[self._at : end])
                out.append(json.dumps(value, ensure_ascii=False))
                self._open, self._at = None, end + len("</parameter>")
            self.sent += out[-1]

    def _convert(self, key: str, raw: str) -> Any:
        raw = raw[:-1] if raw.endswith("\n") else raw
        text = f"<function={self.name}>\n<parameter={key}>\n{raw}\n</parameter>\n</function>"
        try:
            return self._parse(text, self._tools)["arguments"].get(key, raw)
        except Exception:  # a value the parser cannot convert (e.g. "1.5" for an integer)
            return raw

    def finish(self, arguments: Any) -> tuple[str, str]:
        """(the last fragment, the call's whole arguments text) for the parsed arguments (None:
        the call did not parse, e.g. cut short by max_tokens: it is what was streamed)."""
        if arguments is None:
            return "", self.sent
        whole = json.dumps(arguments if isinstance(arguments, dict) else {}, ensure_ascii=False)
        if whole.startswith(self.sent):
            return whole[len(self.sent) :], whole
        return "", whole  # unconstrained text the parser read otherwise than streamed
