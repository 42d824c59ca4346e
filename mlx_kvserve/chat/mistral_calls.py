"""Mistral's tool calls (mlx-lm's `mistral` parser): their grammar and streaming, for the layout
of Mistral's v13 tokenizer templates (Devstral 2, Ministral 3, Mistral Large 3):

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}

Each call opens with `[TOOL_CALLS]`, nothing closes it: the answer ends after the last call's
JSON (the end-of-sequence token follows in history). The grammar makes the model write a
declared function's name, `[ARGS]` and its arguments as JSON following the function's schema,
in the canonical form the template's `tojson` writes, so a tool loop re-renders what it sampled.

The older layouts, v7 (Mistral Small 3, 3.1: one JSON list of `{"name", "arguments", "id"}`
objects) and v11 (Mistral Small 3.2, Magistral, Devstral 1: `name[CALL_ID]id[ARGS]{...}`), are
in chat.mistral_legacy_calls, whose `mistral_layout` tells the three apart by rendering a probe
call with the model's own template.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_kvserve.chat.call_syntax import CallPiece, Marker, Parameters, callable_tools
from mlx_kvserve.chat.request import Tool

_NAME = re.compile(r"[\w-]+")  # what the parser reads as a name before `[ARGS]`
_HEADER = re.compile(r"(?:\[TOOL_CALLS\])?\s*([\w-]+)\s*\[ARGS\]\s*")
V13_PROBE = '[TOOL_CALLS]fn_probe[ARGS]{"k": 1}'

# why a request none of whose tools this format can call is refused
_UNCALLABLE = (
    "this model writes a tool's name before `[ARGS]`, so it needs letters, digits, `_` or `-` only."
)


class MistralSyntax:
    """The CallSyntax of the v13 `[TOOL_CALLS]name[ARGS]{json}` layout."""

    format = "mistral"
    lead = ""
    calls_per_block = False
    between = ""  # each call opens with its own [TOOL_CALLS], nothing between them

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, Any],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        args = marker("[ARGS]")
        names, rules = [], []
        for k, tool in callable_tools(tools, lambda name: _NAME.fullmatch(name), _UNCALLABLE):
            schema = {**parameters(tool), "x-guidance": style}
            names.append(f"fn_{k}")
            rules.append(f"fn_{k}: {json.dumps(tool.name)} {args} %json {json.dumps(schema)}")
        return "\n".join([f"call_body: {' | '.join(names)}", *rules])

    def stream(self, parse: Any, tools: list[dict[str, Any]] | None) -> NamedJsonStream:
        return NamedJsonStream(_HEADER)


class NamedJsonStream:
    """Follows the calls of one answer as it grows, each a header that names the function
    (`header`, its group 1 the name, an optional group 2 the call id the model wrote: Mistral's
    `name[ARGS]`, v11's `name[CALL_ID]id[ARGS]`, Llama 3's `name", "parameters": `)
    followed by the JSON arguments: the name once its header is whole, then the arguments as
    they are written, to the end of the JSON value."""

    def __init__(self, header: re.Pattern[str]) -> None:
        self._header = header
        self._pos = 0
        self._slot = -1
        self._in_args = False
        self._depth = 0
        self._string = self._escaped = False
        self.sent: dict[int, str] = {}

    def feed(self, text: str) -> list[CallPiece]:
        out: list[CallPiece] = []
        while self._pos < len(text):
            if not self._in_args:
                header = self._header.search(text, self._pos)
                if header is None or header.end() == len(text):  # `[ARGS]  ` may grow
                    return out
                self._slot += 1
                self.sent[self._slot] = ""
                call_id = header.group(2) if header.re.groups > 1 else None  # the model's own
                out.append(CallPiece(self._slot, header.group(1), id=call_id))
                self._pos, self._in_args = header.end(), True
                self._depth, self._string, self._escaped = 0, False, False
            end = self._value_end(text)
            fresh = text[self._pos : end]
            if fresh:
                self.sent[self._slot] += fresh
                out.append(CallPiece(self._slot, fragment=fresh))
            self._pos = end
            if self._in_args:
                return out
        return out

    def _value_end(self, text: str) -> int:
        """Where the JSON value being written ends in `text` (its length if not yet)."""
        for i in range(self._pos, len(text)):
            ch = text[i]
            if self._string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._string = False
            elif ch == '"':
                self._string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._in_args = False
                    return i + 1
        return len(text)

    def finish(self, slot: int, arguments: Any) -> tuple[str, str]:
        sent = self.sent.get(slot, "")
        if arguments is None:
            return "", sent
        try:
            if json.loads(sent) == arguments:
                return "", sent
        except ValueError:
            pass
        whole = json.dumps(arguments if isinstance(arguments, dict) else {}, ensure_ascii=False)
        if whole.startswith(sent):
            return whole[len(sent) :], whole
        return "", whole  # unconstrained text the parser read otherwise than streamed


MISTRAL = MistralSyntax()
