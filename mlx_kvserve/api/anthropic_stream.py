"""The model's output events as Anthropic content blocks, streamed or whole.

Reasoning becomes a `thinking` block whose `signature` is the exact sampled text sealed with the
install's key (`ReasoningSeal`), so a client that replays the block lets the server re-render the
turn token for token. Streamed, a block opens with `content_block_start`, grows by deltas
(`thinking_delta`, `text_delta`, `input_json_delta`) and a thinking block ends with one
`signature_delta` before its `content_block_stop`, as in Anthropic's streaming reference.
"""

from __future__ import annotations

import json

from mlx_kvserve.api.reading import Event
from mlx_kvserve.chat import ToolCall
from mlx_kvserve.chat.events import ContentDelta, ReasoningDelta, ToolCallDelta, ToolCallStarted
from mlx_kvserve.chat.reasoning.reasoning_seal import ReasoningSeal
from mlx_kvserve.json_value import JSON

SSEvent = tuple[str, dict[str, JSON]]


class BlockStream:
    """Turns output events into `content_block_*` events; one block is open at a time."""

    def __init__(self, seal: ReasoningSeal, *, omit_thinking: bool = False) -> None:
        self.seal = seal
        self.omit_thinking = omit_thinking  # thinking.display "omitted": signature only
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.reasoning: list[str] = []  # the open thinking block's exact text

    def feed(self, event: Event) -> list[SSEvent]:
        """The SSE events for one output event (none for events that are not content)."""
        if isinstance(event, ReasoningDelta):
            out = self._open("thinking", {"thinking": "", "signature": ""})
            self.reasoning.append(event.text)
            if not self.omit_thinking and event.text:
                out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            return out
        if isinstance(event, ContentDelta):
            out = self._open("text", {"text": ""})
            return [*out, self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ToolCallStarted):
            out = self.close()
            block = {"id": event.id, "name": event.name, "input": {}}
            return out + self._start("tool_use", block)
        if isinstance(event, ToolCallDelta):
            return [self._delta({"type": "input_json_delta", "partial_json": event.arguments})]
        return []

    def close(self) -> list[SSEvent]:
        """End the open block (a thinking block with its signature first)."""
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            signature = self.seal.seal("".join(self.reasoning))
            out.append(self._delta({"type": "signature_delta", "signature": signature}))
            self.reasoning = []
        out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.kind = None
        return out

    def _open(self, kind: str, empty: dict[str, JSON]) -> list[SSEvent]:
        if self.kind == kind:
            return []
        return self.close() + self._start(kind, empty)

    def _start(self, kind: str, block: dict[str, JSON]) -> list[SSEvent]:
        self.index += 1
        self.kind = kind
        payload = {"type": "content_block_start", "index": self.index}
        return [("content_block_start", {**payload, "content_block": {"type": kind, **block}})]

    def _delta(self, delta: dict[str, JSON]) -> SSEvent:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )


def content_blocks(
    reasoning: str,
    text: str,
    calls: list[ToolCall],
    seal: ReasoningSeal,
    *,
    omit_thinking: bool = False,
) -> list[dict[str, JSON]]:
    """A whole answer's content: thinking (sealed), then text, then tool_use blocks."""
    content: list[dict[str, JSON]] = []
    if reasoning:
        shown = "" if omit_thinking else reasoning
        content.append({"type": "thinking", "thinking": shown, "signature": seal.seal(reasoning)})
    if text:
        content.append({"type": "text", "text": text})
    return content + [tool_use(c.id, c.name, c.arguments) for c in calls]


def tool_use(call_id: str, name: str, arguments: str) -> dict[str, JSON]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = {}  # a call cut off by max_tokens: its arguments never closed
    return {
        "type": "tool_use",
        "id": call_id,
        "name": name,
        "input": value if isinstance(value, dict) else {},
    }
