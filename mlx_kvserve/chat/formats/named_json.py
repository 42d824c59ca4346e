"""The stream of calls written as a header that names the function, then its JSON arguments
(Mistral's `name[ARGS]{...}`, v11's `name[CALL_ID]id[ARGS]{...}`, Llama 3's
`{"name": "NAME", "parameters": {...}}`)."""

from __future__ import annotations

import json
import re

from mlx_kvserve.chat.call_syntax import CallPiece
from mlx_kvserve.json_value import JSON


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

    def finish(self, slot: int, arguments: JSON) -> tuple[str, str]:
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
