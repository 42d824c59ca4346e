"""Anthropic Messages request bodies, as the current API reference and Claude Code send them.

Unknown fields are ignored, as Anthropic ignores them (`cache_control`, `citations`, `metadata`,
`service_tier`, `container`, `mcp_servers`, ...). Unknown *block*, *tool*, *thinking* and
*context edit* types are a 400 naming the type's path (`messages.3.content.1.type`): a block the
server would silently drop could change the answer.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.schemas import MAX_STOPS, Body, Seed, _Body, _is_union_tag
from mlx_kvserve.json_value import JSON

MIN_THINKING_BUDGET = 1024  # the API's floor for thinking.budget_tokens


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class Base64Source(_Body):
    type: Literal["base64"]
    media_type: str | None = None  # not trusted: the format is read from the bytes
    data: str


class URLSource(_Body):
    type: Literal["url"]
    url: Annotated[str, Field(min_length=1)]


class ImageBlock(_Body):
    """An image: base64 (Claude Code's pasted screenshots and Read tool), or a URL fetched
    where `--image-urls` allows it."""

    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


ToolResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, JSON] = Field(default_factory=dict)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[ToolResultPart] | None = None
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: JSON) -> JSON:
        """Name the part the server cannot show the model (documents, search results...)."""
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind not in ("text", "image"):
                    raise ValueError(
                        f"tool_result content {i} has type {kind!r}; 'text' and 'image' are "
                        "supported"
                    )
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextBlock))


class ThinkingBlock(_Body):
    """Reasoning the server (or another) returned; `signature` is the opaque replay handle."""

    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None  # required by Anthropic; a missing one simply never opens


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]
BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class SystemMessageConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class AnthropicMessage(_Body):
    """A user or assistant turn, or (mid-conversation-system beta) a system message in place."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    clear_at: Literal["next_user_message", "never"] | None = None  # system messages only
    output_config: SystemMessageConfig | None = None  # system messages only; accepted


# Client tools have an input_schema; Anthropic-defined tools are typed by a dated name.
SERVER_TOOLS = (  # run by Anthropic's servers: accepted, not offered to the model (documented)
    "web_search_",
    "web_fetch_",
    "code_execution_",
    "tool_search_tool_",
    "mcp_toolset",
    "advisor_",
)
CLIENT_DEFINED_TOOLS = (  # run by the client on a schema only Anthropic's models know: a 400
    "bash_",
    "text_editor_",
    "computer_",
    "memory_",
    "browser_toolset_",
    "computer_toolset_",
)


class AnthropicTool(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    description: str | None = None
    input_schema: dict[str, JSON] | None = None
    type: str | None = None

    def kind(self) -> Literal["client", "server", "anthropic", "unknown"]:
        kind = self.type
        if kind in (None, "custom"):
            return "client"
        if kind.startswith(SERVER_TOOLS):
            return "server"
        if kind.startswith(CLIENT_DEFINED_TOOLS):
            return "anthropic"
        return "unknown"


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormatSpec(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, JSON] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormatSpec | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class ThinkingEnabled(_Body):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET)]
    display: Literal["summarized", "omitted", "updates"] | None = None


class ThinkingAdaptive(_Body):
    type: Literal["adaptive", "between_tools"]
    display: Literal["summarized", "omitted", "updates"] | None = None


class ThinkingDisabled(_Body):
    type: Literal["disabled"]


ThinkingConfig = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


class TurnsKeep(_Body):
    type: Literal["thinking_turns"]
    value: Annotated[int, Field(ge=0)]


class AllKeep(_Body):
    type: Literal["all"]


class ClearThinking(_Body):
    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | Annotated[TurnsKeep | AllKeep, Field(discriminator="type")] = TurnsKeep(
        type="thinking_turns", value=1
    )

    def kept_turns(self) -> int | None:
        """How many of the newest assistant turns keep their thinking; None: all."""
        return self.keep.value if isinstance(self.keep, TurnsKeep) else None


class ClearToolUses(_Body):
    """Accepted, not applied: the prompt is rendered whole (docs/claude-code-and-codex.md)."""

    type: Literal["clear_tool_uses_20250919"]
    trigger: dict[str, JSON] | None = None
    keep: dict[str, JSON] | None = None
    clear_at_least: dict[str, JSON] | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class Compact(_Body):
    """Accepted, not applied: no server-side compaction here (docs/claude-code-and-codex.md)."""

    type: Literal["compact_20260112"]
    instructions: str | None = None
    pause_after_compaction: bool = False
    trigger: dict[str, JSON] | None = None


ContextEdit = Annotated[ClearThinking | ClearToolUses | Compact, Field(discriminator="type")]


class ContextManagement(_Body):
    edits: list[ContextEdit] = Field(default_factory=list)


class CountTokensRequest(_Body):
    model: str | None = None
    system: str | list[TextBlock] | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(CountTokensRequest):
    model: str  # required by the API (any name is served)
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    seed: Seed | None = None  # extensions, as on the OpenAI bodies (docs/api.md)
    ignore_eos: bool = False
    speculative: bool = True  # false: no speculative decoding for it
    metadata: dict[str, JSON] | None = None
    stream: bool = False


def parse_body(model: type[Body], data: JSON) -> Body:
    """Validate an Anthropic body, or a 400 whose `param` is the JSON path in the body sent
    (pydantic's union branches and discriminator tags taken out of its error location)."""
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        missing = [e for e in errors if e["type"] == "missing"]
        first = (missing or sorted(errors, key=lambda e: -len(e["loc"])))[0]
        param = json_path(first["loc"], data)
        if first["type"] == "union_tag_invalid":
            tag = first.get("ctx", {}).get("tag")
            expected = first.get("ctx", {}).get("expected_tags", "")
            param += ".type"
            message = f"Invalid value for '{param}': type {tag!r} is not supported here"
            raise APIError(400, f"{message} (supported: {expected}).", param=param) from None
        if first["type"] == "missing":
            raise APIError(400, f"Missing required parameter: '{param}'.", param=param) from None
        value = first.get("input")
        shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
        message = f"Invalid value for '{param}': {first['msg']} (got {shown[:80]})."
        raise APIError(400, message, param=param or None, code="invalid_value") from None


def json_path(loc: tuple[int | str, ...], data: JSON) -> str:
    """`loc` as a dotted path through `data`, without pydantic's union and tag segments."""
    node, parts, tagged = data, [], False
    for i, part in enumerate(loc):
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            parts.append(str(part))
            node, tagged = node[part], False
        elif isinstance(node, dict) and not tagged and node.get("type") == part:
            tagged = True  # a discriminator tag, once per object: `content.0.thinking.thinking`
        elif isinstance(node, dict) and isinstance(part, str) and part in node:
            parts.append(part)
            node, tagged = node[part], False
        elif i == len(loc) - 1 and not _is_union_tag(part) and not str(part).startswith("literal"):
            parts.append(str(part))  # a missing field, or a scalar's own check
    return ".".join(parts)
