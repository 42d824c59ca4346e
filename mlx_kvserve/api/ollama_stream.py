"""Ollama's answers: NDJSON lines while streaming (`application/x-ndjson`), one object
otherwise, for `/api/chat` (`message`) and `/api/generate` (`response`).

Each line is a whole JSON object. Reasoning comes as `thinking`, tool calls as complete objects
with their arguments as a JSON object (Ollama streams them whole, not as deltas). The last
object has `done: true`, `done_reason` and the counts and durations in nanoseconds Ollama
reports: `total_duration` (from the request's arrival), `load_duration` (waiting for the model),
`prompt_eval_duration` (until prefill ended) and `eval_duration` (the answer), and for
`/api/generate` `context`, the token ids to continue from. A failure after
the stream began is one `{"error": ...}` line, as Ollama writes it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve.api.openai_chat import finite, token_text
from mlx_kvserve.api.reading import Failed, Finished, Generation, Logprobs, Usage
from mlx_kvserve.chat import ToolCall
from mlx_kvserve.chat.events import ContentDelta, ReasoningDelta
from mlx_kvserve.engine.requests import TokenLogprob
from mlx_kvserve.json_value import JSON

NDJSON = "application/x-ndjson"
Shape = Literal["chat", "generate"]


@dataclass
class Timing:
    """When the request arrived and when its model was ready (perf_counter seconds)."""

    arrived: float = field(default_factory=time.perf_counter)
    loaded: float | None = None

    def model_ready(self) -> None:
        self.loaded = time.perf_counter()


@dataclass(frozen=True)
class Answer:
    """How the answer is written: its shape, the model name as asked, logprobs or not, and
    whether the last object carries `context` (`/api/generate` without `raw`)."""

    shape: Shape
    model: str
    logprobs: bool = False
    top_logprobs: int = 0
    context: bool = False


def created_at() -> str:
    """Now, in RFC 3339 with a `Z` (as Ollama's `created_at`)."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def head(answer: Answer) -> dict[str, JSON]:
    return {"model": answer.model, "created_at": created_at()}


def piece(answer: Answer, content: str = "", thinking: str | None = None) -> dict[str, JSON]:
    """The text part of a chunk: `message` for chat, `response` for generate."""
    if answer.shape == "chat":
        message: dict[str, JSON] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        return {"message": message}
    body: dict[str, JSON] = {"response": content}
    if thinking:
        body["thinking"] = thinking
    return body


def streamed(generation: Generation, answer: Answer, timing: Timing, keepalive: float) -> Response:
    lines = _lines(generation, answer, timing, keepalive)
    return StreamingResponse(lines, media_type=NDJSON, headers={"Cache-Control": "no-cache"})


async def _lines(
    generation: Generation, answer: Answer, timing: Timing, keepalive: float
) -> AsyncIterator[str]:
    pending: list[TokenLogprob] = []
    async for event in generation.events(keepalive):
        if isinstance(event, Logprobs):
            pending.extend(event.items)
        elif isinstance(event, ContentDelta | ReasoningDelta):
            is_text = isinstance(event, ContentDelta)
            chunk = {
                **head(answer),
                **piece(answer, event.text if is_text else "", None if is_text else event.text),
                "done": False,
            }
            if answer.logprobs and pending:
                chunk["logprobs"], pending = logprobs(pending, answer), []
            yield line(chunk)
        elif isinstance(event, Finished):
            calls = generation.parser.calls
            if calls:
                chunk = {**head(answer), **piece(answer), "done": False}
                _with_calls(chunk, answer, calls)
                yield line(chunk)
            final = {**head(answer), **piece(answer), **done(event, generation, timing)}
            if answer.context:
                final["context"] = context(generation)
            if answer.logprobs and pending:
                final["logprobs"] = logprobs(pending, answer)
            yield line(final)
        elif isinstance(event, Failed):
            yield line({"error": event.message})


async def whole(
    request: Request, generation: Generation, answer: Answer, timing: Timing
) -> Response:
    """`stream: false`: the whole answer as one object."""
    result = await generation.result(request)
    body = {
        **head(answer),
        **piece(answer, result.content, result.reasoning or None),
        **done(result.finished, generation, timing),
    }
    if result.calls:
        _with_calls(body, answer, result.calls)
    if answer.context:
        body["context"] = context(generation)
    if answer.logprobs:
        body["logprobs"] = logprobs(result.logprobs, answer)
    return JSONResponse(body)


def done(finished: Finished, generation: Generation, timing: Timing) -> dict[str, JSON]:
    """The last object's fields: why it ended, and Ollama's counts and durations."""
    end = time.perf_counter()
    loaded = timing.loaded if timing.loaded is not None else timing.arrived
    prefilled = generation.prefilled_at if generation.prefilled_at is not None else end
    usage: Usage = finished.usage
    return {
        "done": True,
        # Ollama ends a turn with tool calls as "stop"
        "done_reason": "length" if finished.reason == "length" else "stop",
        "total_duration": _ns(end - timing.arrived),
        "load_duration": _ns(loaded - timing.arrived),
        "prompt_eval_count": usage.prompt_tokens,
        "prompt_eval_duration": _ns(prefilled - max(loaded, generation.req.started)),
        "eval_count": usage.completion_tokens,
        "eval_duration": _ns(end - prefilled),
    }


def context(generation: Generation) -> list[JSON]:
    """Ollama's `context`: the prompt's and the answer's token ids, which a client sends back
    to continue the exchange (the engine's own ids, not the text tokenized again)."""
    return [*generation.req.prompt_tokens, *generation.req.sampled]


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _with_calls(body: dict[str, JSON], answer: Answer, calls: list[ToolCall]) -> None:
    listed: list[JSON] = [tool_call(call, i) for i, call in enumerate(calls)]
    if answer.shape == "chat":
        message = body["message"]
        assert isinstance(message, dict)
        message["tool_calls"] = listed
    else:
        body["tool_calls"] = listed


def tool_call(call: ToolCall, index: int) -> dict[str, JSON]:
    """A call as Ollama writes it: its arguments a JSON object."""
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):  # a freeform tool's raw input
        arguments = {"input": call.arguments}
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


def logprobs(items: list[TokenLogprob], answer: Answer) -> list[JSON]:
    return [
        {
            **_token(item.token, item.logprob),
            "top_logprobs": [_token(t, lp) for t, lp in item.top[: answer.top_logprobs]],
        }
        for item in items
    ]


def _token(raw: bytes, logprob: float) -> dict[str, JSON]:
    return {"token": token_text(raw), "logprob": finite(logprob), "bytes": list(raw)}


def line(payload: dict[str, JSON]) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


def status_lines(statuses: list[dict[str, JSON]], stream: bool) -> Response:
    """`/api/pull`'s progress: NDJSON lines, or the last one alone."""
    if not stream:
        return JSONResponse(statuses[-1])

    async def lines() -> AsyncIterator[str]:
        for status in statuses:
            yield line(status)

    return StreamingResponse(lines(), media_type=NDJSON)
