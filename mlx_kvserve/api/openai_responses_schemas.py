"""OpenAI Responses request bodies (the stateless subset this server implements)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from mlx_kvserve.api.schemas import _Body

INPUT_ITEM_TYPES = {"message", "function_call", "function_call_output", "reasoning"}


class ContentPart(_Body):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""
    refusal: str | None = None


class InputItem(_Body):
    """One input item; `type` is optional for messages (the SDK's 'easy' message form)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None

    @field_validator("content", "output", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind not in {"input_text", "output_text", "text", "refusal"}:
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported by this server "
                        "(input_text and output_text are)"
                    )
        return value

    def text(self, value: str | list[ContentPart] | None) -> str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        return "".join(p.text or p.refusal or "" for p in value)


class FunctionTool(_Body):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for tool in value:
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                if kind != "function":
                    raise ValueError(
                        f"tools of type {kind!r} are not supported by this server "
                        "(only 'function' tools are)"
                    )
        return value
