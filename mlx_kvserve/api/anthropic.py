"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages protocol.

Claude Code speaks this (`/v1/messages?beta=true`, any `anthropic-beta` header: the query and the
header change nothing here). `anthropic_request` turns the body into the one internal
ChatRequest; `anthropic_stream` turns the engine's events back into Anthropic content blocks,
reasoning as `thinking` blocks with a sealed `signature`. Usage follows Anthropic's meaning:
`input_tokens` were prefilled, `cache_read_input_tokens` came from the prompt cache, so the two
add up to the prompt.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve.api.anthropic_request import omit_thinking_text, to_chat_request
from mlx_kvserve.api.anthropic_schemas import CountTokensRequest, MessagesRequest, parse_body
from mlx_kvserve.api.anthropic_stream import BlockStream, content_blocks
from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import count_chat_tokens, served_model, start_chat
from mlx_kvserve.api.images import image_reader
from mlx_kvserve.api.reading import Failed, Finished, Generation, Started, Usage
from mlx_kvserve.api.seal import reasoning_seal
from mlx_kvserve.json_value import JSON

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def messages(request: Request) -> Response:
    """Anthropic Messages, as Claude Code sends it: content blocks, tools, thinking and
    context-management edits; streamed or one body."""
    settings = request.app.state.settings
    body = parse_body(MessagesRequest, await read_json(request, settings.max_body_bytes))
    seal = reasoning_seal(request)
    chat = await run_in_threadpool(  # off the loop: images decode
        functools.partial(
            to_chat_request,
            body,
            keep_billing_header=settings.keep_billing_header,
            seal=seal,
            images=image_reader(request),
        )
    )
    generation = await start_chat(request, chat, model=body.model, id_prefix="toolu_")
    blocks = BlockStream(seal, omit_thinking=omit_thinking_text(body))
    if body.stream:
        events = _stream(generation, blocks, settings.keepalive_seconds)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    result = await generation.result(request)
    content = content_blocks(
        result.reasoning, result.content, result.calls, seal, omit_thinking=blocks.omit_thinking
    )
    return JSONResponse(
        {
            **_message_head(generation),
            "content": content,
            **_stop(result.finished),
            "usage": usage(result.finished.usage),
        }
    )


async def count_tokens(request: Request) -> Response:
    """The input tokens the same `/v1/messages` request would have."""
    settings = request.app.state.settings
    body = parse_body(CountTokensRequest, await read_json(request, settings.max_body_bytes))
    served_model(request, body.model)  # an unknown name is a 404 before any work
    chat = await run_in_threadpool(
        functools.partial(
            to_chat_request,
            body,
            keep_billing_header=settings.keep_billing_header,
            seal=reasoning_seal(request),
            images=image_reader(request),
        )
    )
    return JSONResponse({"input_tokens": await count_chat_tokens(request, chat, body.model)})


async def _stream(
    generation: Generation, blocks: BlockStream, keepalive: float
) -> AsyncIterator[str]:
    """message_start, then content blocks (thinking / text / tool_use) with deltas, then
    message_delta with the stop reason and usage, then message_stop."""
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
        elif isinstance(event, Finished):
            for name, payload in blocks.close():
                yield _sse(name, payload)
            yield _sse(
                "message_delta",
                {"type": "message_delta", "delta": _stop(event), "usage": usage(event.usage)},
            )
            yield _sse("message_stop", {"type": "message_stop"})
        elif isinstance(event, Failed):
            error = APIError(event.status, event.message)
            yield _sse("error", error.anthropic_body())
        else:
            for name, payload in blocks.feed(event):
                yield _sse(name, payload)


def _message_head(generation: Generation) -> dict[str, JSON]:
    return {
        "id": "msg_" + generation.id,
        "type": "message",
        "role": "assistant",
        "model": generation.model,
    }


def _stop(finished: Finished) -> dict[str, JSON]:
    if finished.reason == "tool_calls":
        reason = "tool_use"
    elif finished.reason == "length":
        reason = "max_tokens"
    elif finished.stop_sequence is not None:
        reason = "stop_sequence"
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": finished.stop_sequence}


def usage(u: Usage) -> dict[str, JSON]:
    """Anthropic's meaning: input_tokens were prefilled; cache reads came from our cache."""
    return {
        "input_tokens": u.prefilled_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


def _sse(event: str, payload: dict[str, JSON]) -> str:
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
