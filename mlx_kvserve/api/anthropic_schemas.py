"""Anthropic Messages request bodies. Unknown fields are ignored, as Anthropic ignores them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from mlx_kvserve.api.schemas import MAX_STOPS, _Body

SUPPORTED_BLOCKS = {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        """Name an unsupported block (image, document...) instead of a union error."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind not in SUPPORTED_BLOCKS:
                    raise ValueError(
                        f"content blocks of type {kind!r} are not supported by this server "
                        "(text, tool_use, tool_result and thinking blocks are)"
                    )
                if kind == "tool_result" and isinstance(part.get("content"), list):
                    for inner in part["content"]:
                        if not isinstance(inner, dict) or inner.get("type") != "text":
                            raise ValueError("tool_result content supports only text blocks")
        return value


class AnthropicTool(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormatSpec(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormatSpec | None = None
    effort: str | None = None


class CountTokensRequest(_Body):
    model: str | None = None
    system: str | list[TextBlock] | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    model: str  # required by the API (any name is served)
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    stream: bool = False
