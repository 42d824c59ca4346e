"""POST /v1/chat/completions and /v1/completions: validate, tokenize, queue, respond."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.prompts import chat_prompt, text_prompt
from mlx_kvserve.api.responses import Shape
from mlx_kvserve.api.schemas import ChatCompletionRequest, CompletionRequest, parse
from mlx_kvserve.api.streaming import collect, sse_events
from mlx_kvserve.engine import (
    Engine,
    EngineBusy,
    EngineNotReady,
    GenerationRequest,
    SamplingParams,
)

RETRY_AFTER_SECONDS = "2"


async def chat_completions(request: Request) -> Response:
    return await _complete(request, ChatCompletionRequest, "chat")


async def completions(request: Request) -> Response:
    return await _complete(request, CompletionRequest, "text")


async def _complete(request: Request, schema: type, kind: str) -> Response:
    state = request.app.state
    engine: Engine = state.engine
    body = parse(schema, await read_json(request, state.settings.max_body_bytes))
    if body.model not in (None, state.model_id):
        raise APIError(
            404,
            f"The model '{body.model}' does not exist; this server serves '{state.model_id}'.",
            param="model",
            code="model_not_found",
        )
    if not engine.ready.is_set():
        raise _unavailable(engine.load_error or "The model is still loading; retry shortly.")
    build = chat_prompt if kind == "chat" else text_prompt
    prompt, boundaries = await run_in_threadpool(build, engine.tokenizer, body)
    req = GenerationRequest(
        prompt_tokens=prompt,
        params=_sampling(body, len(prompt), engine.context_length),
        kind=kind,
        boundaries=boundaries,
    )
    req.bind(asyncio.get_running_loop())
    try:
        engine.submit(req)
    except EngineBusy:
        raise _unavailable("The server is busy: the request queue is full.") from None
    except EngineNotReady as exc:
        raise _unavailable(str(exc)) from None
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    shape = Shape(kind, prefix + req.request_id, state.model_id, int(req.created))
    if body.stream:
        events = sse_events(
            req,
            shape,
            include_usage=body.include_usage(),
            keepalive=state.settings.keepalive_seconds,
        )
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    text, done = await collect(req, request)
    return JSONResponse(shape.full(text, done))


def _sampling(body: Any, prompt_tokens: int, context: int | None) -> SamplingParams:
    """Sampling parameters; max_tokens is clipped to the room left in the context window."""
    room = None if context is None else context - prompt_tokens
    if room is not None and room < 1:
        raise APIError(
            400,
            f"The prompt is {prompt_tokens} tokens, which leaves no room in the model's "
            f"context of {context} tokens.",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    wanted = body.token_limit()
    limit = min(x for x in (wanted, room) if x is not None) if (wanted or room) else 256
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        max_tokens=limit,
        stop=body.stop_strings(),
    )


def _unavailable(message: str) -> APIError:
    return APIError(
        503, message, code="server_unavailable", headers={"Retry-After": RETRY_AFTER_SECONDS}
    )
