"""Kimi K3's tool calls (mlx-lm's `kimi_k3` parser, picked by the XTML vocabulary): their grammar
and streaming.

Kimi K3 writes every call of a turn in one `tools` section of its XTML tags; a call's arguments
are either one tag per key or one JSON object, which the grammar writes (typed by the tool's
schema, in the canonical form `tojson` writes):

    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|><|open|>json type="object"<|sep|>
    {"key": "value"}<|close|>json<|sep|><|close|>call<|sep|>...<|close|>tools<|sep|>

Calls are numbered from 1 in the order written, as a template's `loop.index` numbers them.
"""

from __future__ import annotations

import json
import re

from mlx_lm.tool_parsers.kimi_k3 import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.call_syntax import (
    CallPiece,
    Marker,
    Parameters,
    ParseToolCall,
    callable_tools,
)
from mlx_kvserve.chat.formats.kimi_k2 import _partial_suffix, _reads_as
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
_JSON_OPEN = f'{OPEN}json type="object"{SEP}'
_JSON_CLOSE = f"{CLOSE}json{SEP}"
_NAME = re.compile(r'[^\s"&<>|]+')  # read back whole from `tool="..."`, nothing to unescape
_HEAD = re.compile(
    r'call\s+tool="([^"]+)"[^<]*' + re.escape(SEP) + r"\s*" + re.escape(_JSON_OPEN), re.DOTALL
)

# why a request none of whose tools this format can call is refused
_UNCALLABLE = (
    "this model writes a tool's name in an attribute, so a name needs at least one "
    "character and no spaces, quotes, `&`, `<`, `>` or `|`."
)


class KimiK3Syntax:
    """The `kimi_k3` CallSyntax."""

    format = "kimi_k3"
    lead = ""
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
        """`call_body`: one to `most` calls of the declared tools, numbered from 1, then the
        section's end."""
        heads, rules = [], []
        for k, tool in callable_tools(tools, lambda name: _NAME.fullmatch(name), _UNCALLABLE):
            schema = {**parameters(tool), "x-guidance": style}
            head = json.dumps(f'call tool="{tool.name}" index=', ensure_ascii=False)
            rules.append(f"fn_{k}: {head}")
            rules.append(f"args_{k}: %json {json.dumps(schema)}")
            heads.append(k)
        most = max(most, 1)
        opening, closing = _items(SEP + _JSON_OPEN, marker), _items(_JSON_CLOSE + CLOSE, marker)
        for i in range(1, most + 1):
            index = json.dumps(json.dumps(str(i)))  # index="i"
            calls = " | ".join(f"fn_{k} {index} {opening} args_{k}" for k in heads)
            rules.append(f'call_{i}: {marker(OPEN)} ({calls}) {closing} "call" {marker(SEP)}')
        # the calls in order, each numbered by its place
        body = "call_1" + "".join(f" (call_{i}" for i in range(2, most + 1)) + ")?" * (most - 1)
        return "\n".join([f"call_body: {body} {_items(end, marker)}", *rules])

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> KimiK3Stream:
        return KimiK3Stream()


def _items(text: str, marker: Marker) -> str:
    """Fixed text with its XTML tags as tokens where the tokenizer has them."""
    parts = [p for p in re.split(r"(<\|(?:open|close|sep)\|>)", text) if p]
    return " ".join(
        marker(p) if p in (OPEN, CLOSE, SEP) else json.dumps(p, ensure_ascii=False) for p in parts
    )


syntax = KimiK3Syntax()


class KimiK3Stream:
    """Follows one section: each call's name once its JSON block opens, then its JSON arguments
    as they are written (the model's own text, which the parser reads with `json.loads`)."""

    def __init__(self) -> None:
        self._sent: list[str] = []  # per call: the argument text passed on so far

    def feed(self, text: str) -> list[CallPiece]:
        out: list[CallPiece] = []
        for slot, part in enumerate(text.split(OPEN + "call")[1:]):
            head = _HEAD.match(part)
            if head is None:
                return out
            if slot == len(self._sent):
                self._sent.append("")
                out.append(CallPiece(slot, head.group(1)))
            body = part[head.end() :]
            closed = body.find(_JSON_CLOSE)
            if closed >= 0:
                body = body[:closed]
            else:
                body = body[: len(body) - _partial_suffix(body, _JSON_CLOSE)]
            if len(body) > len(self._sent[slot]):
                out.append(CallPiece(slot, fragment=body[len(self._sent[slot]) :]))
                self._sent[slot] = body
        return out

    def finish(self, slot: int, arguments: JSON) -> tuple[str, str]:
        """The arguments are the text streamed (what the parser read), or what it read."""
        sent = self._sent[slot] if slot < len(self._sent) else ""
        if arguments is None or (isinstance(arguments, dict) and _reads_as(sent, arguments)):
            return "", sent
        return "", json.dumps(arguments if isinstance(arguments, dict) else {})


FORMAT = ToolFormat("kimi_k3", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "kimi_k3" else None
