"""The one internal request that every wire protocol is translated into.

Field meanings follow the OpenAI chat API, the richest of the three protocols; the Anthropic and
Responses adapters map their own names onto these (e.g. `tool_use` blocks become `ToolCall`s,
`tool_result` blocks become `tool` messages).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal

from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.images import Image
from mlx_kvserve.json_value import JSON

Role = Literal["system", "user", "assistant", "tool"]


def new_call_id(prefix: str = "call_") -> str:
    """An id for a generated tool call, in the style of the protocol asking (call_, toolu_)."""
    return prefix + secrets.token_hex(12)


ToolKind = Literal["function", "custom"]


@dataclass(frozen=True)
class ToolCall:
    """One tool call, in history or generated.

    A function call's `arguments` is JSON text of an object; a custom (freeform) tool's call
    carries its raw input there, as the model wrote it.
    """

    id: str
    name: str
    arguments: str
    kind: ToolKind = "function"


@dataclass
class Message:
    """One conversation turn: its text, and its images in their places among the text.

    `content` is the whole text. `parts` is empty for a text-only turn; when the turn carries
    images it holds the text pieces and the images in the order the client sent them (their
    text pieces joined are `content`), so a vision template can place each image where it was.
    """

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # on role "tool": the call this message answers
    name: str | None = None  # on role "tool": the function's name, when the client sent it
    origin: str | None = None  # where the client sent it (e.g. "input[3]"), for error messages
    # On role "assistant": the reasoning the model wrote before this turn's answer, as the client
    # replayed it (OpenAI `reasoning_content`/`reasoning`, Anthropic `thinking` blocks, Responses
    # `reasoning` items). Templates that render past reasoning read it as `reasoning_content`.
    reasoning: str | None = None
    parts: tuple[str | Image, ...] = ()

    @classmethod
    def from_parts(cls, role: Role, parts: list[str | Image], **fields: object) -> Message:
        """A turn from its text pieces and images in order (`parts` kept only with an image)."""
        content = "".join(p for p in parts if isinstance(p, str))
        kept = tuple(parts) if any(isinstance(p, Image) for p in parts) else ()
        return cls(role, content, parts=kept, **fields)  # type: ignore[arg-type]

    @property
    def images(self) -> list[Image]:
        """The turn's images, in order."""
        return [p for p in self.parts if isinstance(p, Image)]


@dataclass(frozen=True)
class InputGrammar:
    """The grammar a custom tool's raw input must follow (OpenAI `format: {type: grammar}`)."""

    syntax: Literal["lark", "regex"]
    definition: str


# What a template without freeform tools is shown of a custom tool: a function whose one string
# parameter carries the raw input.
CUSTOM_PARAMETERS: dict[str, JSON] = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Tool:
    """A tool the model may call.

    A "function" takes JSON arguments valid against `parameters`; a "custom" (freeform) tool takes
    raw text, constrained by `grammar` when it has one (None: any text).
    """

    name: str
    description: str | None = None
    parameters: dict[str, JSON] = field(default_factory=lambda: {"type": "object"})
    kind: ToolKind = "function"
    grammar: InputGrammar | None = None

    @property
    def is_custom(self) -> bool:
        return self.kind == "custom"

    def as_openai(self) -> dict[str, JSON]:
        """The OpenAI function-tool shape that chat templates expect as `tools=` (a custom tool
        as a function of one string parameter, `input`)."""
        function: dict[str, JSON] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = CUSTOM_PARAMETERS if self.is_custom else self.parameters
        return {"type": "function", "function": function}

    def as_freeform(self) -> dict[str, JSON]:
        """A custom tool as the Hermes fallback lists it (the OpenAI custom-tool shape)."""
        listing: dict[str, JSON] = {"type": "custom", "name": self.name}
        if self.description is not None:
            listing["description"] = self.description
        if self.grammar is not None:
            listing["format"] = {
                "type": "grammar",
                "syntax": self.grammar.syntax,
                "definition": self.grammar.definition,
            }
        return listing


@dataclass(frozen=True)
class ToolChoice:
    """none: never call; auto: the model decides; required: at least one call; function: `name`."""

    mode: Literal["none", "auto", "required", "function"] = "auto"
    name: str | None = None
    parallel: bool = True  # False: at most one call

    @classmethod
    def plain(cls, mode: str | None, *, has_tools: bool, parallel: bool = True) -> ToolChoice:
        """A choice given as a bare string (or left out: `auto` with tools, else `none`), as the
        OpenAI chat and Responses APIs take it; `required` needs a tool."""
        mode = mode or ("auto" if has_tools else "none")
        if mode == "required" and not has_tools:
            raise InvalidRequest(
                "tool_choice 'required' needs at least one tool.", param="tool_choice"
            )
        return cls(mode, parallel=parallel)  # type: ignore[arg-type]


@dataclass(frozen=True)
class OutputFormat:
    """Plain text, any JSON object, or JSON valid against `schema`."""

    kind: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, JSON] | None = None
    name: str | None = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


@dataclass(frozen=True)
class Thinking:
    """What the client asked of the model's reasoning, in protocol-neutral terms.

    OpenAI `reasoning_effort` / Responses `reasoning.effort`, Anthropic `thinking` and
    `output_config.effort` all land here; the templating layer maps it onto what the model's
    template understands (`enable_thinking`, gpt-oss `reasoning_effort`), and a model without
    reasoning controls ignores it.
    """

    enabled: bool | None = None  # None: the template's own default
    effort: Effort | None = None
    budget: int | None = None  # reasoning tokens at most; None: no limit


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None  # None: the room left in the context window
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False  # end-of-sequence ids are not sampled: the answer runs its length
    speculative: bool = True  # False: this request drafts nothing (docs/speculation.md)


@dataclass
class ChatRequest:
    """What the engine layer needs from any protocol's chat request."""

    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    output: OutputFormat = field(default_factory=OutputFormat)
    sampling: Sampling = field(default_factory=Sampling)
    thinking: Thinking = field(default_factory=Thinking)
    # Extra variables for the chat template (OpenAI-compatible `chat_template_kwargs`), over the
    # server's `--chat-template-kwargs` default.
    template_kwargs: dict[str, JSON] = field(default_factory=dict)

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"
