"""Request bodies, validated with pydantic so that every wrong field gets a precise 400.

Strict types: a string where a number belongs is an error, as with the OpenAI API. Unknown fields
are ignored, because clients send many optional OpenAI parameters we do not need.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.chat import Sampling
from mlx_kvserve.json_value import JSON

MAX_STOPS = 16
MAX_CHOICES = 8  # OpenAI's `n`: rows of the batch one request may take
MAX_PROMPTS = 64  # prompts of one text completion request
Seed = Annotated[int, Field(ge=0, lt=2**64)]  # MLX seeds are uint64


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


Body = TypeVar("Body", bound=_Body)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    """An image: a data URL, or an http(s) URL where `--image-urls` allows it."""

    type: Literal["image_url"]
    image_url: ImageURL | Annotated[str, Field(min_length=1)]  # a bare URL, as some clients send

    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


def _part_kind(part: JSON) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return {"text": "TextPart", "image_url": "ImagePart"}.get(kind)  # type: ignore[arg-type]


# Chosen by `type` (so an error names the field of the part sent, not of another kind); the
# tags are dropped from error paths (`_is_union_tag`).
ContentPart = Annotated[
    Annotated[TextPart, Tag("TextPart")] | Annotated[ImagePart, Tag("ImagePart")],
    Discriminator(_part_kind),
]


class FunctionCall(_Body):
    name: Annotated[str, Field(min_length=1)]
    arguments: str = ""


class ToolCallIn(_Body):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # Past reasoning of an assistant turn: llama.cpp, vLLM and DeepSeek call it
    # `reasoning_content`, mlx-lm and OpenRouter `reasoning`.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: JSON) -> JSON:
        """Name the unsupported part type instead of pydantic's union-branch noise."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind not in ("text", "image_url"):
                    raise ValueError(
                        f"unsupported content part type {kind!r}; 'text' and 'image_url' parts "
                        "are supported"
                    )
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class _Sampling(_Body):
    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Seed | None = None
    ignore_eos: bool = False  # vLLM's and llama.cpp's extension: run to max_tokens
    speculative: bool = True  # extension: false opts this request out of speculative decoding
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # choices, each its own batch row
    user: str | None = None

    def sampling(self, top_logprobs: int | None) -> Sampling:
        """The internal sampling settings; `top_logprobs` None: no log-probabilities (each API
        says differently whether it wants them: chat's flag and count, text's count)."""
        return Sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            speculative=self.speculative,
            max_tokens=self.token_limit(),
            stop=self.stop_strings(),
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
        )

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, JSON] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, JSON] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    chat_template_kwargs: dict[str, JSON] | None = None
    reasoning_effort: Effort | None = None
    thinking_token_budget: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    # The four shapes the API takes: text, token ids, or a list of either (evaluation harnesses
    # batch up to MAX_PROMPTS prompts: one choice each). Checked by hand for a clear message;
    # kept as the list of prompts.
    prompt: list[str | list[int]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False  # the prompt before the completion (api/text_echo.py)
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: only with echo

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: JSON) -> list[str | list[int]]:
        """Text, token ids, or a list of either, as a list of prompts."""
        if isinstance(value, str) or _token_ids(value):
            return [value]
        if (
            isinstance(value, list)
            and value
            and all(isinstance(v, str) or _token_ids(v) for v in value)
        ):
            if len(value) > MAX_PROMPTS:
                raise PydanticCustomError(
                    "prompts",
                    "at most {limit} prompts per request (got {count})",
                    {"limit": MAX_PROMPTS, "count": len(value)},
                )
            return value
        raise PydanticCustomError(
            "prompt_shape",
            "expected text, a non-empty list of token ids, or a list of either",
        )

    def token_limit(self) -> int | None:
        return self.max_tokens


def _token_ids(value: JSON) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_token_id(v) for v in value)


def _is_token_id(value: JSON) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse(model: type[Body], data: JSON) -> Body:
    """Validate `data` into `model`, or raise a 400 naming the first offending parameter."""
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = _describe(exc)
        raise APIError(400, message, param=param or None, code="invalid_value") from None


def _describe(exc: ValidationError) -> tuple[str, str]:
    """Pick the most useful error: union branches produce several, prefer a missing field."""
    errors = exc.errors(include_url=False)
    # A missing field first; else the deepest error: of a union's branches, the one that got
    # furthest names the field (`input.3.encrypted_content`, not `input`).
    first = next((e for e in errors if e["type"] == "missing"), None) or max(
        errors, key=lambda e: len(e["loc"])
    )
    loc = [str(p) for p in first["loc"] if not _is_union_tag(p)]
    param = ".".join(loc) if loc else None
    if first["type"] == "missing":
        return f"Missing required parameter: '{param}'.", param or ""
    value = first.get("input")
    shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
    return f"Invalid value for '{param}': {first['msg']} (got {shown[:80]}).", param or ""


def _is_union_tag(part: int | str) -> bool:
    text = str(part)
    return text in {
        "str",
        "int",
        "float",
        "bool",
        "list[str]",
        "list[TextPart]",
        "TextPart",
        "ContentPart",
        "InputImage",
        "ImagePart",
        "ImageURL",
        "list[union[TextPart,ImagePart]]",
        "list[ToolCallIn]",
        "list[InputItem]",
        "list[ContentPart]",
        "list[ToolDef]",
        "NamedToolChoice",
        "literal['none','auto','required']",
        "none",
    } or text.startswith(("list[", "function-", "constrained-"))
