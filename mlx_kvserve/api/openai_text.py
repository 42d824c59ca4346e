"""POST /v1/completions: OpenAI text completions, on the same engine path as chat."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve.api import text_echo
from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import start_text
from mlx_kvserve.api.openai_chat import (
    SSE_HEADERS,
    SYSTEM_FINGERPRINT,
    finite,
    sse,
    token_text,
    usage,
)
from mlx_kvserve.api.openai_text_choices import several
from mlx_kvserve.api.reading import Failed, Finished, Generation, Logprobs
from mlx_kvserve.api.schemas import CompletionRequest, parse
from mlx_kvserve.chat import Sampling
from mlx_kvserve.chat.events import ContentDelta
from mlx_kvserve.engine.requests import TokenLogprob
from mlx_kvserve.json_value import JSON


async def completions(request: Request) -> Response:
    """OpenAI text completions of a prompt (text or token ids), with logprobs; streamed or
    one body. `echo`, several prompts and `max_tokens: 0` (evaluation harnesses' prompt
    scoring) are answered by api/text_echo.py."""
    body = parse(
        CompletionRequest, await read_json(request, request.app.state.settings.max_body_bytes)
    )
    if text_echo.wanted(body):
        if body.n > 1:  # api/openai_text_choices.py serves several choices of one generation
            raise APIError(
                400,
                "n above 1 is not supported with echo, several prompts or max_tokens 0.",
                param="n",
            )
        return await text_echo.completions(request, body)
    n_logprobs = body.logprobs
    sampling = Sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        speculative=body.speculative,
        max_tokens=body.token_limit(),
        stop=body.stop_strings(),
        logprobs=n_logprobs is not None,
        top_logprobs=n_logprobs or 0,
    )
    generation = await start_text(request, body.prompt[0], sampling, model=body.model, n=body.n)
    if body.n > 1:
        return await several(request, generation, body, _head(generation), _logprobs)
    if body.stream:
        events = _stream(generation, body, request.app.state.settings.keepalive_seconds)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    result = await generation.result(request)
    choice = {
        "index": 0,
        "text": result.content,
        "logprobs": _logprobs(result.logprobs, 0) if n_logprobs is not None else None,
        "finish_reason": result.finished.reason,
    }
    return JSONResponse(
        {**_head(generation), "choices": [choice], "usage": usage(result.finished.usage)}
    )


async def _stream(
    generation: Generation, body: CompletionRequest, keepalive: float
) -> AsyncIterator[str]:
    head = _head(generation)
    offset = 0
    pending: list[TokenLogprob] = []
    async for event in generation.events(keepalive):
        if event is None:
            yield ": keep-alive\n\n"
        elif isinstance(event, Logprobs):
            pending.extend(event.items)
        elif isinstance(event, ContentDelta | Finished):
            text = event.text if isinstance(event, ContentDelta) else ""
            finish = event.reason if isinstance(event, Finished) else None
            logprobs = None
            if body.logprobs is not None and (pending or finish is None):
                logprobs = _logprobs(pending, offset)
                offset += sum(len(token_text(t.token)) for t in pending)
                pending = []
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            yield sse({**head, "choices": [choice]})
            if isinstance(event, Finished):
                if body.include_usage():
                    yield sse({**head, "choices": [], "usage": usage(event.usage)})
                yield "data: [DONE]\n\n"
        elif isinstance(event, Failed):
            yield sse(APIError(event.status, event.message).body())
            yield "data: [DONE]\n\n"


def _head(generation: Generation) -> dict[str, JSON]:
    return {
        "id": "cmpl-" + generation.id,
        "object": "text_completion",
        "created": generation.created,
        "model": generation.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def _logprobs(items: list[TokenLogprob], offset: int) -> dict[str, JSON]:
    """The legacy completions shape: parallel lists plus text offsets."""
    tokens = [token_text(t.token) for t in items]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [finite(t.logprob) for t in items],
        "top_logprobs": [{token_text(b): finite(lp) for b, lp in t.top} for t in items],
        "text_offset": offsets,
    }
