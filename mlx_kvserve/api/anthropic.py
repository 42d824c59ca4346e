"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages protocol.

Claude Code speaks this. Each body becomes the one internal ChatRequest: `system` becomes the
system message, `tool_use` blocks become tool calls, `tool_result` blocks become tool messages
(in their order, before the user's text), thinking blocks are dropped (the templates served here
do not re-render reasoning), and the engine's events come back as Anthropic content blocks. Usage
follows Anthropic's meaning: `input_tokens` were prefilled, `cache_read_input_tokens` came from
the prompt cache, so the two add up to the prompt.

Claude Code starts its system prompt with `x-anthropic-billing-header: ...; cch=<hex>;`, a line
that changes on every request and would defeat the prompt cache; it is dropped before templating
(`--keep-billing-header` keeps it).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve.api.anthropic_schemas import (
    AnthropicMessage,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import (
    Failed,
    Finished,
    Generation,
    Started,
    Usage,
    count_chat_tokens,
    served_model,
    start_chat,
)
from mlx_kvserve.api.schemas import parse
from mlx_kvserve.chat import (
    ChatRequest,
    Message,
    OutputFormat,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
)
from mlx_kvserve.chat.output import ContentDelta, ToolCallDelta, ToolCallStarted

log = logging.getLogger("mlx_kvserve.api")

BILLING_HEADER = re.compile(r"\A\s*x-anthropic-billing-header:[^\n]*(\n|\Z)", re.IGNORECASE)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def messages(request: Request) -> Response:
    settings = request.app.state.settings
    body = parse(MessagesRequest, await read_json(request, settings.max_body_bytes))
    chat = to_chat_request(body, keep_billing_header=settings.keep_billing_header)
    generation = await start_chat(request, chat, model=body.model, id_prefix="toolu_")
    if body.stream:
        events = _stream(generation, settings.keepalive_seconds)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    result = await generation.result(request)
    content: list[dict[str, Any]] = []
    if result.content:
        content.append({"type": "text", "text": result.content})
    content += [_tool_use(c.id, c.name, c.arguments) for c in result.calls]
    return JSONResponse(
        {
            **_message_head(generation),
            "content": content,
            **_stop(result.finished),
            "usage": usage(result.finished.usage),
        }
    )


async def count_tokens(request: Request) -> Response:
    settings = request.app.state.settings
    body = parse(CountTokensRequest, await read_json(request, settings.max_body_bytes))
    served_model(request, body.model)
    chat = to_chat_request(body, keep_billing_header=settings.keep_billing_header)
    return JSONResponse({"input_tokens": await count_chat_tokens(request, chat)})


def to_chat_request(body: CountTokensRequest, *, keep_billing_header: bool) -> ChatRequest:
    """The internal request for an Anthropic body (count_tokens bodies have no sampling)."""
    messages: list[Message] = []
    system = _system_text(body.system)
    if system and not keep_billing_header:
        system = BILLING_HEADER.sub("", system, count=1)
    if system:
        messages.append(Message("system", system))
    for message in body.messages:
        messages += _messages(message)
    tools = _tools(body)
    sampling = Sampling()
    output = OutputFormat()
    if isinstance(body, MessagesRequest):
        fmt = body.output_config.format if body.output_config else None
        if fmt is not None:
            output = OutputFormat("json_schema", fmt.schema_)
        sampling = Sampling(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=body.max_tokens,
            stop=tuple(body.stop_sequences or ()),
        )
    return ChatRequest(messages, tools, _tool_choice(body, tools), output, sampling)


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None:
        return ""
    return system if isinstance(system, str) else "\n\n".join(b.text for b in system)


def _messages(message: AnthropicMessage) -> list[Message]:
    if isinstance(message.content, str):
        return [Message(message.role, message.content)]
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(
                ToolCall(block.id, block.name, json.dumps(block.input, ensure_ascii=False))
            )
        elif isinstance(block, ToolResultBlock):
            text = block.text()
            results.append(
                Message(
                    "tool",
                    f"Error: {text}" if block.is_error else text,
                    tool_call_id=block.tool_use_id,
                )
            )
        else:
            assert isinstance(block, ThinkingBlock)  # not re-rendered by these templates
    text = "".join(texts)
    if message.role == "assistant":
        return [Message("assistant", text, calls)]
    return results + ([Message("user", text)] if text or not results else [])


def _tools(body: CountTokensRequest) -> list[Tool]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            log.info("ignoring server tool %r (%s): it cannot run here", tool.name, tool.type)
            continue
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


async def _stream(generation: Generation, keepalive: float) -> AsyncIterator[str]:
    """message_start, then content blocks (text / tool_use) with deltas, then message_delta
    with the stop reason and usage, then message_stop."""
    block: int = -1  # index of the open content block
    kind: str | None = None  # "text" or "tool_use"
    started = False
    async for event in generation.events(keepalive):
        if event is None:
            yield _sse("ping", {"type": "ping"}) if started else ": keep-alive\n\n"
            continue
        if isinstance(event, Started):
            yield _sse(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        **_message_head(generation),
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": usage(Usage(event.prompt_tokens, event.cached_tokens, 0)),
                    },
                },
            )
            yield _sse("ping", {"type": "ping"})
            started = True
        elif isinstance(event, ContentDelta):
            if kind != "text":
                if kind is not None:
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": block})
                block, kind = block + 1, "text"
                yield _sse(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": block,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
            yield _sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": block,
                    "delta": {"type": "text_delta", "text": event.text},
                },
            )
        elif isinstance(event, ToolCallStarted):
            if kind is not None:
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": block})
            block, kind = block + 1, "tool_use"
            yield _sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": block,
                    "content_block": {
                        "type": "tool_use",
                        "id": event.id,
                        "name": event.name,
                        "input": {},
                    },
                },
            )
        elif isinstance(event, ToolCallDelta):
            yield _sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": block,
                    "delta": {"type": "input_json_delta", "partial_json": event.arguments},
                },
            )
        elif isinstance(event, Finished):
            if kind is not None:
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": block})
            yield _sse(
                "message_delta",
                {"type": "message_delta", "delta": _stop(event), "usage": usage(event.usage)},
            )
            yield _sse("message_stop", {"type": "message_stop"})
        elif isinstance(event, Failed):
            error = APIError(event.status, event.message)
            yield _sse("error", error.anthropic_body())


def _message_head(generation: Generation) -> dict[str, Any]:
    return {
        "id": "msg_" + generation.id,
        "type": "message",
        "role": "assistant",
        "model": generation.model,
    }


def _stop(finished: Finished) -> dict[str, Any]:
    if finished.reason == "tool_calls":
        reason = "tool_use"
    elif finished.reason == "length":
        reason = "max_tokens"
    elif finished.stop_sequence is not None:
        reason = "stop_sequence"
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": finished.stop_sequence}


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
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


def usage(u: Usage) -> dict[str, Any]:
    """Anthropic's meaning: input_tokens were prefilled; cache reads came from our cache."""
    return {
        "input_tokens": u.prefilled_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


def _sse(event: str, payload: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
