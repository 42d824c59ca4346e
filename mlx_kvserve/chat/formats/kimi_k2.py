"""Kimi K2's tool calls (mlx-lm's `kimi_k2` parser): their grammar and streaming.

Kimi K2 writes every call of a turn in one section of special tokens, each call named by an id
`functions.NAME:IDX` and its arguments one JSON object:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
    {"key": "value"}<|tool_call_end|>...<|tool_calls_section_end|>

Its template renders a past call's id where the model wrote it, so the call's id is the one the
model wrote (the stream passes it on) and a tool loop re-renders what was sampled. Only when the
model numbers two calls of a section alike does the later one get the next free index: clients
tell a turn's calls (and their results) apart by id. The arguments
are JSON following the tool's schema in the canonical form the template's `tojson` writes.
"""

from __future__ import annotations

import json
import re

from mlx_lm.tool_parsers.kimi_k2 import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.call_syntax import (
    CallPiece,
    Marker,
    Parameters,
    ParseToolCall,
    callable_tools,
)
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

BEGIN = "<|tool_call_begin|>"
ARGUMENTS = "<|tool_call_argument_begin|>"
END = "<|tool_call_end|>"
_NAME = re.compile(r"[^\s<>|]+")  # what the parser's `functions.(.+?):\d+` reads back whole
_HEAD = re.compile(r"\s*((?:functions\.)?(.+?):\d+)\s*" + re.escape(ARGUMENTS), re.DOTALL)

# why a request none of whose tools this format can call is refused
_UNCALLABLE = (
    "this model writes a tool's name in its calls' ids, so a name needs at least one "
    "character and no spaces, `<`, `>` or `|`."
)


class KimiSyntax:
    """The `kimi_k2` CallSyntax."""

    format = "kimi_k2"
    lead = ""  # the template writes the section right after the content
    calls_per_block = True

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        """`call_body`: one to `most` calls of the declared tools, then the section's end."""
        names, rules = [], []
        for k, tool in callable_tools(tools, lambda name: _NAME.fullmatch(name), _UNCALLABLE):
            schema = {**parameters(tool), "x-guidance": style}
            head = json.dumps(f"functions.{tool.name}:", ensure_ascii=False)
            names.append(f"fn_{k}")
            rules.append(f"fn_{k}: {head} INDEX {marker(ARGUMENTS)} %json {json.dumps(schema)}")
        count = "" if most <= 1 else f"{{1,{most}}}"
        return "\n".join(
            [
                f"call_body: call_item{count} {marker(end)}",
                f"call_item: {marker(BEGIN)} ({' | '.join(names)}) {marker(END)}",
                "INDEX: /[0-9]{1,3}/",
                *rules,
            ]
        )

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> KimiStream:
        return KimiStream()


syntax = KimiSyntax()


class KimiStream:
    """Follows one section: each call's id and name once `<|tool_call_argument_begin|>` closes
    them, then its JSON arguments as they are written (the model's own text, which the parser
    reads with `json.loads`)."""

    def __init__(self) -> None:
        self._sent: list[str] = []  # per call: the argument text passed on so far
        self._ids: set[str] = set()  # the ids given so far

    def feed(self, text: str) -> list[CallPiece]:
        out: list[CallPiece] = []
        for slot, part in enumerate(text.split(BEGIN)[1:]):
            head = _HEAD.match(part)
            if head is None:
                return out
            if slot == len(self._sent):
                self._sent.append("")
                out.append(CallPiece(slot, head.group(2), id=self._unique(head.group(1))))
            body = part[head.end() :]
            closed = body.find(END)
            body = body[:closed] if closed >= 0 else body[: len(body) - _partial_suffix(body, END)]
            body = body.lstrip()
            if len(body) > len(self._sent[slot]):
                out.append(CallPiece(slot, fragment=body[len(self._sent[slot]) :]))
                self._sent[slot] = body
        return out

    def _unique(self, call_id: str) -> str:
        """The model's id, or (for one it already gave a call of this section) its name with
        the next index none of them has."""
        if call_id in self._ids:
            used = [int(i.rpartition(":")[2]) for i in self._ids]
            call_id = f"{call_id.rpartition(':')[0]}:{max(used) + 1}"
        self._ids.add(call_id)
        return call_id

    def finish(self, slot: int, arguments: JSON) -> tuple[str, str]:
        """The arguments are the text streamed (what the parser read), or `{}` for a call whose
        arguments are not an object."""
        sent = self._sent[slot] if slot < len(self._sent) else ""
        if arguments is None or (isinstance(arguments, dict) and _reads_as(sent, arguments)):
            return "", sent
        return "", json.dumps(arguments if isinstance(arguments, dict) else {})


def _reads_as(text: str, arguments: dict[str, JSON]) -> bool:
    try:
        return json.loads(text) == arguments
    except ValueError:
        return False


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


FORMAT = ToolFormat("kimi_k2", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "kimi_k2" else None
