"""What the call syntaxes that list keyword arguments (pythonic, Gemma 4) share: a Lark
separated list whose items may each be left out, and the stream of such calls."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from mlx_kvserve.chat.call_syntax import CallPiece, ParseToolCall
from mlx_kvserve.json_value import JSON


def separated(prefix: str, items: list[tuple[str, bool]], sep: str, rules: list[str]) -> str:
    """A Lark expression for `items` in order, joined by `sep` (a Lark item), each present
    when required (its flag) or optionally; rules named `prefix_*` are appended to `rules`.

    `first_i` is items i.. with no separator before the first present one, `after_i` items i..
    with the separator before each present one: linear in the number of items."""
    n = len(items)
    rules.append(f'{prefix}_a{n}: ""')
    rules.append(f'{prefix}_f{n}: ""')
    for i in range(n - 1, -1, -1):
        item, required = items[i]
        after, first = f"{prefix}_a{i + 1}", f"{prefix}_f{i + 1}"
        if required:
            rules.append(f"{prefix}_a{i}: {sep} {item} {after}")
            rules.append(f"{prefix}_f{i}: {item} {after}")
        else:
            rules.append(f"{prefix}_a{i}: ({sep} {item})? {after}")
            rules.append(f"{prefix}_f{i}: {item} {after} | {first}")
    return f"{prefix}_f0"


@dataclass(frozen=True)
class KeywordShape:
    """Where a keyword-argument call layout puts its parts: `[name(k=v, ...), ...]` (pythonic)
    or `call:name{k:v,...}` (Gemma 4)."""

    opener: str  # the character before the first call's name
    args_open: str  # ends the name
    assign: str  # between a key and its value
    args_close: str  # ends the arguments
    quotes: tuple[str, ...]  # what opens and closes a string (a value's `,` may sit in one)
    escapes: bool  # a backslash escapes the next character in a string
    wrap: Callable[[str, str, str], str]  # one call of one argument, for the format's parser


class KeywordStream:
    """Follows one block of keyword-argument calls as it grows: each call's name once its
    arguments open, then `{"key": ` at each key's `assign` and the value's JSON when the value
    ends (the next top-level `,` or `args_close`), converted by the format's own parser from
    the value's own text. A call's fragments, plus the `}` `finish` adds, concatenate to
    `json.dumps` of the arguments the parser reads."""

    def __init__(
        self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None, shape: KeywordShape
    ):
        self._parse, self._tools, self._shape = parse, tools, shape
        self._pos = 0
        self._state = "opener"  # opener, name, key, value, between
        self._start = 0  # where the current name, key or value began
        self._slot = -1
        self._name = self._key = self._quote = ""
        self._depth = 0
        self._escaped = False
        self.sent: dict[int, str] = {}

    def feed(self, text: str) -> list[CallPiece]:
        out: list[CallPiece] = []
        while self._pos < len(text):
            step = self._step(text, out)
            if step == 0:  # a quote may be starting: wait for the rest of it
                break
            self._pos += step
        return out

    def _step(self, text: str, out: list[CallPiece]) -> int:
        shape, state, ch = self._shape, self._state, text[self._pos]
        if state == "opener" and ch == shape.opener:
            self._state, self._start = "name", self._pos + 1
        elif state == "name" and ch == shape.args_open:
            self._slot += 1
            self._name = text[self._start : self._pos].strip()
            self.sent[self._slot] = ""
            out.append(CallPiece(self._slot, self._name))
            self._state, self._start = "key", self._pos + 1
        elif state == "key" and ch == shape.args_close:
            self._state = "between"
        elif state == "key" and ch == shape.assign:
            self._key = text[self._start : self._pos].strip(" ,")
            lead = "{" if not self.sent[self._slot] else ", "
            self._emit(out, lead + json.dumps(self._key) + ": ")
            self._state, self._start = "value", self._pos + 1
            self._depth, self._quote, self._escaped = 0, "", False
        elif state == "value":
            return self._value_step(text, out)
        elif state == "between" and ch == ",":
            self._state, self._start = "name", self._pos + 1
        return 1

    def _value_step(self, text: str, out: list[CallPiece]) -> int:
        shape, ch = self._shape, text[self._pos]
        if self._quote:
            if self._escaped:
                self._escaped = False
            elif shape.escapes and ch == "\\":
                self._escaped = True
            elif text.startswith(self._quote, self._pos):
                self._quote, step = "", len(self._quote)
                return step
            elif self._quote.startswith(text[self._pos :]):
                return 0
            return 1
        for quote in shape.quotes:
            if text.startswith(quote, self._pos):
                self._quote = quote
                return len(quote)
            if len(quote) > 1 and quote.startswith(text[self._pos :]):
                return 0
        if ch in "([{":
            self._depth += 1
        elif ch in ")]}" and self._depth > 0:
            self._depth -= 1
        elif self._depth == 0 and ch in (",", shape.args_close):
            value = text[self._start : self._pos].strip()
            self._emit(out, json.dumps(self._convert(value), ensure_ascii=False))
            closed = ch == shape.args_close
            self._state, self._start = ("between", 0) if closed else ("key", self._pos + 1)
        return 1

    def _emit(self, out: list[CallPiece], fragment: str) -> None:
        self.sent[self._slot] += fragment
        out.append(CallPiece(self._slot, fragment=fragment))

    def _convert(self, value: str) -> JSON:
        try:
            parsed = self._parse(self._shape.wrap(self._name, self._key, value), self._tools)
            return parsed["arguments"][self._key]
        except Exception:  # a value the parser cannot read: pass its text on
            return value

    def finish(self, slot: int, arguments: JSON) -> tuple[str, str]:
        sent = self.sent.get(slot, "")
        if arguments is None:
            return "", sent
        whole = json.dumps(arguments if isinstance(arguments, dict) else {}, ensure_ascii=False)
        if whole.startswith(sent):
            return whole[len(sent) :], whole
        return "", whole  # unconstrained text the parser read otherwise than streamed
