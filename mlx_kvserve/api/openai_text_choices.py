"""POST /v1/completions with `n` above 1: every choice's text, each with its `index`.

Kept beside api/openai_text.py, which serves one choice, so that the one-choice path (and what
it grows: echo, the prompt's logprobs) stays as it is; the choices themselves are read together
by api/choices.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve.api.choices import ChoiceEvent, Choices
from mlx_kvserve.api.openai_chat import SSE_HEADERS, sse, sse_choices, token_text, usage
from mlx_kvserve.api.reading import Finished, Generation, Logprobs
from mlx_kvserve.api.schemas import CompletionRequest
from mlx_kvserve.chat.events import ContentDelta
from mlx_kvserve.engine.requests import TokenLogprob
from mlx_kvserve.json_value import JSON

# api/openai_text's legacy logprobs: (tokens, offset of the first) -> {tokens, text_offset, ...}
TextLogprobs = Callable[[list[TokenLogprob], int], dict[str, JSON]]


async def several(
    request: Request,
    generation: Generation,
    body: CompletionRequest,
    head: dict[str, JSON],
    logprobs: TextLogprobs,
) -> Response:
    """The response to a text completion with several choices, streamed or one body; `head`
    and `logprobs` are api/openai_text's (which imports this module)."""
    choices = Choices(generation)
    if body.stream:
        keepalive = request.app.state.settings.keepalive_seconds
        events = _stream(choices, body, keepalive, head, logprobs)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    results, total = await choices.results(request)
    rows: list[JSON] = [
        {
            "index": i,
            "text": result.content,
            "logprobs": logprobs(result.logprobs, 0) if body.logprobs is not None else None,
            "finish_reason": result.finished.reason,
        }
        for i, result in enumerate(results)
    ]
    return JSONResponse({**head, "choices": rows, "usage": usage(total)})


async def _stream(
    choices: Choices,
    body: CompletionRequest,
    keepalive: float,
    head: dict[str, JSON],
    text_logprobs: TextLogprobs,
) -> AsyncIterator[str]:
    offsets = [0] * len(choices.all)  # each choice's text so far, for its logprobs' offsets
    pending: list[list[TokenLogprob]] = [[] for _ in choices.all]

    def feed(item: ChoiceEvent) -> str | None:
        event, i = item.event, item.index
        if isinstance(event, Logprobs):
            pending[i].extend(event.items)
        elif isinstance(event, ContentDelta | Finished):
            text = event.text if isinstance(event, ContentDelta) else ""
            finish = event.reason if isinstance(event, Finished) else None
            logprobs = None
            if body.logprobs is not None and (pending[i] or finish is None):
                logprobs = text_logprobs(pending[i], offsets[i])
                offsets[i] += sum(len(token_text(t.token)) for t in pending[i])
                pending[i] = []
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice]})
        return None

    events = choices.events(keepalive)
    async for line in sse_choices(events, head, body.include_usage(), feed):
        yield line
