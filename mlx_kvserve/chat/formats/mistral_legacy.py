"""Mistral's older tool-call layouts, constrained and streamed (chat.formats.mistral has v13's
and tells the three apart):

* v11 (Mistral Small 3.2, Magistral, Devstral 1): `[TOOL_CALLS]name[CALL_ID]id[ARGS]{json}` per
  call, no closing marker. mlx-lm's `mistral` parser reads the id as the name, so the format
  parses itself.
* v7 (Mistral Small 3, 3.1): one `[TOOL_CALLS]` and a JSON list of
  `{"name": ..., "arguments": {...}, "id": "..."}` objects, which mlx-lm's parser reads.

Both templates refuse a call id that is not 9 characters long, and the model writes the id
itself: the grammar makes it 9 letters or digits, and that id is the call's id in the response,
so the client sends back an id the template accepts. Ids of other shapes in the history (from
another server, or a client's own) are rendered as a stable 9-character digest
(`fit_call_ids`), so a call and its result still pair up instead of the template refusing
them. A v7 call is announced once its object is complete (its id comes after its arguments),
then its arguments follow in one piece.
"""

from __future__ import annotations

import hashlib
import json
import re

from mlx_kvserve.chat.call_syntax import (
    CallPiece,
    Marker,
    Parameters,
    ParseToolCall,
    callable_tools,
)
from mlx_kvserve.chat.formats.named_json import NamedJsonStream
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.json_value import JSON

ID_RULE = r"CALL_ID9: /[a-zA-Z0-9]{9}/"
_V7_ID = " ".join([json.dumps(', "id": "'), "CALL_ID9", json.dumps('"}')])  # a v7 call's end
_NAME = re.compile(r"[\w-]+")  # what mlx-lm's parser and the template's layout keep whole
_UNCALLABLE = (
    "this model writes a tool's name as a bare word, so it needs letters, digits, `_` or `-` only."
)
_V11_HEADER = re.compile(r"(?:\[TOOL_CALLS\])?\s*([\w-]+)\s*\[CALL_ID\]\s*(\w{9})\s*\[ARGS\]\s*")


def _callable(tools: list[Tool]) -> list[tuple[int, Tool]]:
    return callable_tools(tools, _NAME.fullmatch, _UNCALLABLE)


def parse_v11(text: str, tools: list[dict[str, JSON]] | None = None) -> list[dict[str, JSON]]:
    """The calls of a v11 answer after its first `[TOOL_CALLS]` (raises when there is none)."""
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while (header := _V11_HEADER.search(text, pos)) is not None:
        arguments, pos = decoder.raw_decode(text, header.end())
        calls.append({"name": header.group(1), "arguments": arguments, "id": header.group(2)})
    if not calls:
        raise ValueError("no Mistral v11 tool call")
    return calls


_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def fitted_id(call_id: str, length: int = 9) -> str:
    """`call_id` as the template accepts it: itself when it already is `length` letters or
    digits (the ids these models write), else a stable digest of it in that form, so a call
    and its result still pair up (ids from another server, or a client's own)."""
    if len(call_id) == length and call_id.isascii() and call_id.isalnum():
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode("utf-8")).digest(), "big")
    digits = []
    for _ in range(length):
        number, rest = divmod(number, 62)
        digits.append(_BASE62[rest])
    return "".join(digits)


def fit_call_ids(messages: list[dict[str, JSON]], length: int = 9) -> list[dict[str, JSON]]:
    """Template messages whose call ids (`tool_calls[].id`, `tool_call_id`) are fitted."""
    out = []
    for message in messages:
        item = dict(message)
        if item.get("tool_calls"):
            item["tool_calls"] = [
                {**call, "id": fitted_id(str(call.get("id", "")), length)}
                for call in item["tool_calls"]
            ]
        if item.get("tool_call_id") is not None:
            item["tool_call_id"] = fitted_id(str(item["tool_call_id"]), length)
        out.append(item)
    return out


class MistralV11Syntax:
    format = "mistral"
    lead = ""
    calls_per_block = False
    between = ""  # each call opens with its own [TOOL_CALLS]

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        call_id, args = marker("[CALL_ID]"), marker("[ARGS]")
        names, rules = [], []
        for k, tool in _callable(tools):
            schema = {**parameters(tool), "x-guidance": style}
            names.append(f"fn_{k}")
            rules.append(
                f"fn_{k}: {json.dumps(tool.name)} {call_id} CALL_ID9 {args} "
                f"%json {json.dumps(schema)}"
            )
        return "\n".join([f"call_body: {' | '.join(names)}", *rules, ID_RULE])

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> NamedJsonStream:
        return NamedJsonStream(_V11_HEADER)


class MistralV7Syntax:
    format = "mistral"
    lead = ""
    calls_per_block = True  # one list holds the turn's calls

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        names, rules = [], []
        for k, tool in _callable(tools):
            schema = {**parameters(tool), "x-guidance": style}
            head = json.dumps(f'{{"name": "{tool.name}", "arguments": ')
            names.append(f"fn_{k}")
            rules.append(f"fn_{k}: {head} %json {json.dumps(schema)} {_V7_ID}")
        more = f' (", " one_call){{0,{most - 1}}}' if most > 1 else ""
        return "\n".join(
            [
                f'call_body: "[" one_call{more} "]"',
                f"one_call: {' | '.join(names)}",
                *rules,
                ID_RULE,
            ]
        )

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> JsonListStream:
        return JsonListStream()


class JsonListStream:
    """Follows a JSON list of call objects as it grows: each call, once its object is whole,
    is announced with its name and the id the model wrote, then its arguments in one piece."""

    def __init__(self) -> None:
        self._decoder = json.JSONDecoder()
        self._pos = 0
        self._slot = -1
        self.sent: dict[int, str] = {}

    def feed(self, text: str) -> list[CallPiece]:
        out: list[CallPiece] = []
        while True:
            start = self._next_object(text)
            if start is None:
                return out
            try:
                value, end = self._decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                return out  # not whole yet
            self._pos = end
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                continue
            self._slot += 1
            arguments = json.dumps(value.get("arguments", {}), ensure_ascii=False)
            call_id = value.get("id") if isinstance(value.get("id"), str) else None
            out.append(CallPiece(self._slot, value["name"], id=call_id))
            out.append(CallPiece(self._slot, fragment=arguments))
            self.sent[self._slot] = arguments

    def _next_object(self, text: str) -> int | None:
        """Where the next call object starts (past the list's `[` and separating commas)."""
        i = self._pos
        while i < len(text) and text[i] in "[, \n\t":
            i += 1
        return i if i < len(text) and text[i] == "{" else None

    def finish(self, slot: int, arguments: JSON) -> tuple[str, str]:
        sent = self.sent.get(slot, "")
        if arguments is None or (sent and json.loads(sent) == arguments):
            return "", sent
        whole = json.dumps(arguments if isinstance(arguments, dict) else {}, ensure_ascii=False)
        return ("", whole) if sent else (whole, whole)


MISTRAL_V11 = MistralV11Syntax()
MISTRAL_V7 = MistralV7Syntax()
