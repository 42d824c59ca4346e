"""The state of a tool call while the model writes it (chat.output): its text so far, what of
its arguments was passed on, and where its JSON ends."""

from __future__ import annotations

from mlx_kvserve.chat.call_syntax import CallStream
from mlx_kvserve.chat.request import new_call_id


class JsonValueEnd:
    """Finds where one JSON value ends in text that arrives piece by piece."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, text: str) -> int | None:
        """Index in `text` just past the value's end, or None if it has not ended yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif ch == '"':
                self.in_string, self.started = True, True
            elif ch in "{[":
                self.depth, self.started = self.depth + 1, True
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif not ch.isspace():
                self.started = True  # a bare number / literal: ends at a delimiter
            elif self.started and self.depth == 0:
                return i
        return None


class OpenCall:
    """The call being generated: its raw text and how much of it was passed on."""

    def __init__(self, index: int, id_prefix: str) -> None:
        self.index = index
        self.id = new_call_id(id_prefix)
        self.text = ""
        self.name: str | None = None
        self.args_from: int | None = None
        self.args_sent = 0
        self.args_done = False
        self.scanner = JsonValueEnd()
        self.body = JsonValueEnd()  # the whole JSON body: the end marker may sit in a string
        self.body_done = False
        self.freeform_from: int | None = None  # a custom-tool call: where its raw input starts
        self.freeform_sent = 0
        self.stream: CallStream | None = None  # a CallSyntax format's stream of this block
        self.slots: dict[int, tuple[int, str, str]] = {}  # its calls: (index, id, name)
