"""What the model's output becomes, whatever the protocol: content, reasoning, and tool calls as
they form. An `OutputReader` (chat.output.OutputParser, or the model's format's own) makes
them; each wire protocol renders them its own way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mlx_kvserve.chat.request import ToolCall


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Text the model wrote in its reasoning (thinking) section, apart from the answer."""

    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallFinished:
    index: int
    call: ToolCall


OutputEvent = ContentDelta | ReasoningDelta | ToolCallStarted | ToolCallDelta | ToolCallFinished


class OutputReader(Protocol):
    """Reads the model's text as it streams into events, and keeps what it read."""

    calls: list[ToolCall]
    content: str
    reasoning: str

    def feed(self, text: str) -> list[OutputEvent]: ...

    def finish(self) -> list[OutputEvent]:
        """End of generation: what was held back, and a call the model left open."""
        ...
