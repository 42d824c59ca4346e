"""An Anthropic Messages body as the one internal ChatRequest.

* `system` (top level) is the first system message; Claude Code's per-request billing line is
  dropped from it (it would defeat the prompt cache; `--keep-billing-header` keeps it).
* `role: "system"` messages inside `messages` stay system messages where they stand; one with
  `clear_at: "next_user_message"` is left out once a later user message exists, as the API does.
* `image` blocks (base64 or url) stay in their place among the text of a user turn or a
  `tool_result` (api/images.py decides what a model that does not see images is shown); an
  assistant turn with an image is a 400.
* `tool_use` blocks are tool calls; `tool_result` blocks are tool messages, in their order,
  before the user's text.
* `thinking` blocks of an assistant turn become its `Message.reasoning`: the exact sampled text
  when the block's `signature` is a seal this install made, else the visible `thinking` text
  (a foreign or tampered signature is never trusted). `redacted_thinking` is kept only when its
  `data` opens with the seal (it is opaque otherwise).
* `thinking` and `output_config.effort` become `ChatRequest.thinking`.
* `context_management`: `clear_thinking_20251015` is applied (older turns lose their reasoning);
  `clear_tool_uses_20250919` and `compact_20260112` are accepted and not applied.
* Tools: client tools (no type, or `custom`) are offered; Anthropic's server tools (web search,
  code execution, ...) cannot run here and are not offered; Anthropic-defined client tools
  (`bash_*`, `text_editor_*`, ...) have a schema only Anthropic's models know: a 400.
"""

from __future__ import annotations

import json
import logging
import re

from mlx_kvserve.api.anthropic_schemas import (
    AnthropicMessage,
    ClearThinking,
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingDisabled,
    ToolResultBlock,
    ToolUseBlock,
)
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.chat import (
    ChatRequest,
    Message,
    OutputFormat,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
)
from mlx_kvserve.chat.reasoning.reasoning_seal import ReasoningSeal
from mlx_kvserve.chat.request import Thinking
from mlx_kvserve.images import Image
from mlx_kvserve.images.reader import ImageReader

log = logging.getLogger("mlx_kvserve.api")

BILLING_HEADER = re.compile(r"\A\s*x-anthropic-billing-header:[^\n]*(\n|\Z)", re.IGNORECASE)


def to_chat_request(
    body: CountTokensRequest,
    *,
    keep_billing_header: bool,
    seal: ReasoningSeal | None = None,
    images: ImageReader | None = None,
) -> ChatRequest:
    """The internal request for an Anthropic body (count_tokens bodies have no sampling;
    `images`: the server's reader, by default inline images only)."""
    images = images or ImageReader()
    messages: list[Message] = []
    system = _system_text(body.system)
    if system and not keep_billing_header:
        system = BILLING_HEADER.sub("", system, count=1).lstrip("\n")
    if system:
        messages.append(Message("system", system))
    last_user = max((i for i, m in enumerate(body.messages) if m.role == "user"), default=-1)
    for i, message in enumerate(body.messages):
        if message.role == "system" and message.clear_at == "next_user_message" and i < last_user:
            continue
        messages += _messages(message, i, seal, images)
    _clear_thinking(body, messages)
    tools = _tools(body)
    sampling = Sampling()
    output = OutputFormat()
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        output = OutputFormat("json_schema", fmt.schema_)
    if isinstance(body, MessagesRequest):
        sampling = Sampling(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            speculative=body.speculative,
            max_tokens=body.max_tokens,
            stop=tuple(body.stop_sequences or ()),
        )
    return ChatRequest(
        messages, tools, _tool_choice(body, tools), output, sampling, thinking=thinking(body)
    )


def thinking(body: CountTokensRequest) -> Thinking:
    """`thinking` and `output_config.effort` in neutral terms. No `thinking` leaves the model's
    template default; `adaptive` (Claude Code's) turns reasoning on and lets the model size it."""
    effort = body.output_config.effort if body.output_config else None
    config = body.thinking
    if config is None:
        return Thinking(effort=effort)
    if isinstance(config, ThinkingDisabled):
        return Thinking(enabled=False, effort=effort)
    if isinstance(config, ThinkingAdaptive):
        return Thinking(enabled=True, effort=effort)
    budget = config.budget_tokens
    if isinstance(body, MessagesRequest) and budget >= body.max_tokens:
        raise APIError(
            400,
            f"Invalid value for 'thinking.budget_tokens': {budget} must be less than "
            f"max_tokens ({body.max_tokens}).",
            param="thinking.budget_tokens",
        )
    return Thinking(enabled=True, effort=effort, budget=budget)


def omit_thinking_text(body: CountTokensRequest) -> bool:
    """`display: "omitted"`: thinking blocks carry an empty text and the signature only."""
    return getattr(body.thinking, "display", None) == "omitted"


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None:
        return ""
    return system if isinstance(system, str) else "\n\n".join(b.text for b in system)


def _messages(
    message: AnthropicMessage, index: int, seal: ReasoningSeal | None, images: ImageReader
) -> list[Message]:
    where = f"messages.{index}"
    if isinstance(message.content, str):
        return [Message(message.role, message.content)]
    texts: list[str | Image] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    reasoning: list[str] = []
    for j, block in enumerate(message.content):
        if message.role == "system" and not isinstance(block, TextBlock):
            param = f"{where}.content.{j}.type"
            raise APIError(
                400,
                f"Invalid value for '{param}': system messages hold only text blocks "
                f"(got {block.type!r}).",
                param=param,
            )
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            if message.role != "user":
                param = f"{where}.content.{j}"
                raise APIError(400, f"{param}: only user turns carry images.", param=param)
            texts.append(_image(block, f"{where}.content.{j}.source", images))
        elif isinstance(block, ToolUseBlock):
            calls.append(
                ToolCall(block.id, block.name, json.dumps(block.input, ensure_ascii=False))
            )
        elif isinstance(block, ToolResultBlock):
            parts = _result_parts(block, f"{where}.content.{j}", images)
            if block.is_error:
                parts.insert(0, "Error: ")
            results.append(Message.from_parts("tool", parts, tool_call_id=block.tool_use_id))
        elif isinstance(block, ThinkingBlock):
            opened = seal.open(block.signature) if seal and block.signature else None
            reasoning.append(block.thinking if opened is None else opened)
        else:
            assert isinstance(block, RedactedThinkingBlock)
            opened = seal.open(block.data) if seal else None
            if opened is not None:
                reasoning.append(opened)
    text = "".join(t for t in texts if isinstance(t, str))
    if message.role == "assistant":
        past = "\n\n".join(r for r in reasoning if r) or None
        return [Message("assistant", text, calls, reasoning=past)]
    if message.role == "system":
        return [Message("system", text)]
    user = [Message.from_parts("user", texts)] if any(texts) or not results else []
    return results + user


def _image(block: ImageBlock, where: str, images: ImageReader) -> Image:
    source = block.source
    if source.type == "base64":
        return images.from_base64(source.data, f"{where}.data")
    return images.from_url(source.url, f"{where}.url")


def _result_parts(block: ToolResultBlock, where: str, images: ImageReader) -> list[str | Image]:
    """A tool result's text and images in order (an Anthropic `tool_result`'s content)."""
    if not isinstance(block.content, list):
        return [block.content or ""]
    return [
        part.text
        if isinstance(part, TextBlock)
        else _image(part, f"{where}.content.{k}.source", images)
        for k, part in enumerate(block.content)
    ]


def _clear_thinking(body: CountTokensRequest, messages: list[Message]) -> None:
    """Apply `clear_thinking_20251015`: only the newest `keep` assistant turns keep reasoning."""
    edits = body.context_management.edits if body.context_management else []
    for edit in edits:
        if not isinstance(edit, ClearThinking) or edit.kept_turns() is None:
            continue
        turns = [m for m in messages if m.role == "assistant"]
        kept = edit.kept_turns() or 0
        for message in turns[: len(turns) - kept] if kept else turns:
            message.reasoning = None


def _tools(body: CountTokensRequest) -> list[Tool]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        kind = tool.kind()
        if kind == "server":
            log.info("not offering server tool %r (%s): it cannot run here", tool.name, tool.type)
            continue
        if kind != "client":
            param = f"tools.{i}.type"
            why = (
                "an Anthropic-defined tool whose input schema only Anthropic's models know; "
                "define it as a custom tool with an input_schema"
                if kind == "anthropic"
                else "an unknown tool type"
            )
            raise APIError(
                400, f"Invalid value for '{param}': {tool.type!r} is {why}.", param=param
            )
        if not tool.name:
            raise APIError(
                400, f"Missing required parameter: 'tools.{i}.name'.", param=f"tools.{i}"
            )
        if tool.input_schema is None:
            raise APIError(400, f"tools.{i}.input_schema: Field required", param=f"tools.{i}")
        tools.append(Tool(tool.name, tool.description, tool.input_schema))
    return tools


def _tool_choice(body: CountTokensRequest, tools: list[Tool]) -> ToolChoice:
    choice = body.tool_choice
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    parallel = not choice.disable_parallel_tool_use
    if choice.type in {"any", "tool"} and not tools:
        raise APIError(400, f"tool_choice.type '{choice.type}' needs at least one tool.")
    if choice.type == "tool":
        if choice.name not in {t.name for t in tools}:
            raise APIError(
                400, f"tool_choice names the tool {choice.name!r}, which is not among the tools."
            )
        return ToolChoice("function", choice.name, parallel=False)
    mode = {"any": "required", "auto": "auto", "none": "none"}[choice.type]
    return ToolChoice(mode, parallel=parallel)
