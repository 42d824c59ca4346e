"""What the model's output becomes, whatever the protocol: content, reasoning, and tool calls as
they form. `chat.output.OutputParser` makes them; each wire protocol renders them its own way."""

from __future__ import annotations

from dataclasses import dataclass

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
