"""OpenAI Responses request bodies (the stateless subset this server implements).

Tools are validated one by one in `responses_tools` (each kind has its own shape, and an error
names the tool by its index), so here they are plain objects.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from mlx_kvserve.api.schemas import Seed, _Body
from mlx_kvserve.json_value import JSON

TEXT_PART_TYPES = {"input_text", "output_text", "text", "refusal", "reasoning_text", "summary_text"}
# Every documented `include` value: accepted. Only reasoning.encrypted_content changes the output
# (the others name outputs of built-in tools this server never runs, or logprobs it omits).
INCLUDABLE = {
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
}


class ContentPart(_Body):
    type: Literal["input_text", "output_text", "text", "refusal", "reasoning_text", "summary_text"]
    text: str = ""
    refusal: str | None = None


class InputImage(_Body):
    """An image: a data URL, or an http(s) URL where `--image-urls` allows it (no file ids:
    nothing is uploaded to this server)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None


def _part_kind(part: JSON) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "InputImage" if kind == "input_image" else "ContentPart"


# Chosen by `type`, so an error names the field of the part sent; the tags are dropped from
# error paths (api/schemas.py `_is_union_tag`).
Part = Annotated[
    Annotated[ContentPart, Tag("ContentPart")] | Annotated[InputImage, Tag("InputImage")],
    Discriminator(_part_kind),
]


class InputItem(_Body):
    """One input item; `type` is optional for messages (the SDK's 'easy' message form)."""

    type: Literal[
        "message",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "custom_tool_call_output",
        "reasoning",
    ] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a call to a function of a `namespace` tool
    arguments: str | None = None
    input: str | None = None  # custom_tool_call: the raw input
    output: str | list[Part] | None = None
    summary: list[ContentPart] | None = None  # reasoning
    encrypted_content: str | None = None  # reasoning: this server's sealed exact text

    @field_validator("content", "output", mode="before")
    @classmethod
    def _known_parts(cls, value: JSON) -> JSON:
        return _known(value, TEXT_PART_TYPES | {"input_image"})

    @field_validator("summary", mode="before")
    @classmethod
    def _text_parts_only(cls, value: JSON) -> JSON:
        return _known(value, TEXT_PART_TYPES)

    def text(self, value: str | list[Part] | list[ContentPart] | None) -> str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        return "".join(p.text or p.refusal or "" for p in value if isinstance(p, ContentPart))


def _known(value: JSON, kinds: set[str]) -> JSON:
    """Name a part type this server does not take, instead of pydantic's union noise."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in kinds:
                raise ValueError(
                    f"content parts of type {kind!r} are not supported by this server "
                    "(input_text, output_text and input_image are)"
                )
    return value


class FunctionTool(_Body):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, JSON] | None = None
    strict: bool | None = None


class TextInputFormat(_Body):
    type: Literal["text"]


class GrammarInputFormat(_Body):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: Annotated[str, Field(min_length=1)]


class CustomTool(_Body):
    """A freeform tool: its input is raw text, free or following a Lark grammar or a regex."""

    type: Literal["custom"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    format: Annotated[TextInputFormat | GrammarInputFormat, Field(discriminator="type")] | None = (
        None
    )


class NamespaceTool(_Body):
    """A named group of function and custom tools (`tools` are checked one by one)."""

    type: Literal["namespace"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    tools: Annotated[list[dict[str, JSON]], Field(min_length=1)]


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, JSON] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[dict[str, JSON]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, JSON] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    include: list[str] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    seed: Seed | None = None  # extensions, as on the chat body (docs/api.md)
    ignore_eos: bool = False
    speculative: bool = True  # false: no speculative decoding for it
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, JSON] | None = None
    # Accepted and not acted on: caching is automatic here, and there is one service tier.
    prompt_cache_key: str | None = None
    client_metadata: dict[str, JSON] | None = None
    safety_identifier: str | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @field_validator("include")
    @classmethod
    def _documented_includes(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if name not in INCLUDABLE:
                raise ValueError(f"{name!r} is not a documented include value")
        return value

    @property
    def encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])
