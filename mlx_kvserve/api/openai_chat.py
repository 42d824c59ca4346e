"""POST /v1/chat/completions: the OpenAI chat protocol, adapted to and from the internal request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.choices import ChoiceEvent, Choices, Ended
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import start_chat
from mlx_kvserve.api.images import image_reader
from mlx_kvserve.api.reading import Event, Failed, Finished, Logprobs, Result, Usage
from mlx_kvserve.api.schemas import ChatCompletionRequest, ImagePart, Message, TextPart, parse
from mlx_kvserve.chat import (
    ChatRequest,
    OutputFormat,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
)
from mlx_kvserve.chat import Message as ChatMessage
from mlx_kvserve.chat.events import ContentDelta, ReasoningDelta, ToolCallDelta, ToolCallStarted
from mlx_kvserve.engine.requests import TokenLogprob
from mlx_kvserve.images import Image
from mlx_kvserve.images.reader import ImageReader
from mlx_kvserve.json_value import JSON

SYSTEM_FINGERPRINT = "mlx-kvserve"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def chat_completions(request: Request) -> Response:
    """OpenAI Chat Completions: messages, tools, structured output, reasoning, logprobs;
    streamed or one body."""
    body = parse(
        ChatCompletionRequest, await read_json(request, request.app.state.settings.max_body_bytes)
    )
    chat = await run_in_threadpool(to_chat_request, body, image_reader(request))  # images decode
    generation = await start_chat(request, chat, model=body.model, n=body.n)
    choices = Choices(generation)
    if body.stream:
        events = _stream(choices, body, request.app.state.settings.keepalive_seconds)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    results, total = await choices.results(request)
    return JSONResponse(
        {
            **_head(choices, "chat.completion"),
            "choices": [_choice(i, result, body) for i, result in enumerate(results)],
            "usage": usage(total),
        }
    )


def _choice(index: int, result: Result, body: ChatCompletionRequest) -> dict[str, JSON]:
    message: dict[str, JSON] = {"role": "assistant", "content": result.content, "refusal": None}
    if result.reasoning:  # clients read one name or the other
        message["reasoning_content"] = message["reasoning"] = result.reasoning
    if result.calls:
        message["tool_calls"] = [_call(c) for c in result.calls]
        message["content"] = result.content or None
    return {
        "index": index,
        "message": message,
        "logprobs": _logprobs(result.logprobs, body) if body.logprobs else None,
        "finish_reason": result.finished.reason,
    }


def to_chat_request(body: ChatCompletionRequest, images: ImageReader | None = None) -> ChatRequest:
    """The internal request for an OpenAI chat body (`images`: the server's reader; by default
    inline images only)."""
    images = images or ImageReader()
    tools = [
        Tool(t.function.name, t.function.description, t.function.parameters or {"type": "object"})
        for t in body.tools or []
    ]
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        tool_choice = ToolChoice.plain(
            choice, has_tools=bool(tools), parallel=body.parallel_tool_calls
        )
    else:
        name = choice.function.name
        if name not in {t.name for t in tools}:
            raise APIError(
                400,
                f"tool_choice names the function {name!r}, which is not among the tools.",
                param="tool_choice",
            )
        tool_choice = ToolChoice("function", name, parallel=False)
    return ChatRequest(
        messages=[_message(m, i, images) for i, m in enumerate(body.messages)],
        tools=tools,
        tool_choice=tool_choice,
        output=_output_format(body),
        sampling=body.sampling((body.top_logprobs or 0) if body.logprobs else None),
        thinking=Thinking(effort=body.reasoning_effort, budget=body.thinking_token_budget),
        template_kwargs=body.chat_template_kwargs or {},
    )


def _message(m: Message, i: int, images: ImageReader) -> ChatMessage:
    calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
    role = "system" if m.role == "developer" else m.role
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None and role != "assistant":
        field = "reasoning_content" if m.reasoning_content is not None else "reasoning"
        raise APIError(
            400,
            f"messages[{i}].{field}: only assistant messages carry past reasoning.",
            param=f"messages[{i}].{field}",
        )
    name = m.name if role == "tool" else None
    if not isinstance(m.content, list) or all(isinstance(p, TextPart) for p in m.content):
        message = ChatMessage(role, m.text(), calls, m.tool_call_id, name)
    else:
        parts = _parts(m.content, role, i, images)
        message = ChatMessage.from_parts(
            role, parts, tool_calls=calls, tool_call_id=m.tool_call_id, name=name
        )
    message.reasoning = reasoning
    return message


def _parts(
    content: list[TextPart | ImagePart], role: str, i: int, images: ImageReader
) -> list[str | Image]:
    """A message's text and images in order; images only where a user or a tool speaks."""
    parts: list[str | Image] = []
    for j, part in enumerate(content):
        if isinstance(part, TextPart):
            parts.append(part.text)
            continue
        where = f"messages[{i}].content[{j}].image_url"
        if role not in ("user", "tool"):
            raise APIError(400, f"{where}: only user and tool messages carry images.", param=where)
        parts.append(images.from_url(part.url(), where))
    return parts


def _output_format(body: ChatCompletionRequest) -> OutputFormat:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return OutputFormat()
    if fmt.type == "json_object":
        return OutputFormat("json_object")
    if fmt.json_schema is None:
        raise APIError(
            400,
            "response_format of type 'json_schema' needs a 'json_schema' object.",
            param="response_format.json_schema",
        )
    return OutputFormat("json_schema", fmt.json_schema.schema_, fmt.json_schema.name)


async def _stream(
    choices: Choices, body: ChatCompletionRequest, keepalive: float
) -> AsyncIterator[str]:
    head = _head(choices, "chat.completion.chunk")
    streams = [ChoiceStream(i, head, body) for i in range(len(choices.all))]
    for stream in streams:
        yield stream.chunk({"role": "assistant", "content": ""})

    def feed(item: ChoiceEvent) -> str | None:
        return streams[item.index].feed(item.event)

    async for line in sse_choices(choices.events(keepalive), head, body.include_usage(), feed):
        yield line


async def sse_choices(
    events: AsyncIterator[ChoiceEvent | Ended | None],
    head: dict[str, JSON],
    include_usage: bool,
    feed: Callable[[ChoiceEvent], str | None],
) -> AsyncIterator[str]:
    """The event stream of an OpenAI request's choices (chat or text: `feed` makes a choice's
    chunk for its event): keep-alives, the usage chunk once all have finished, `[DONE]`, and
    the one error a failure ends it with."""
    async for item in events:
        if item is None:
            yield ": keep-alive\n\n"
        elif isinstance(item, Ended):
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(item.usage)})
            yield "data: [DONE]\n\n"
        elif isinstance(item.event, Failed):
            yield sse(APIError(item.event.status, item.event.message).body())
            yield "data: [DONE]\n\n"
        else:
            chunk = feed(item)
            if chunk is not None:
                yield chunk


class ChoiceStream:
    """One choice's chunks: its index in every chunk, its logprobs held until its text."""

    def __init__(self, index: int, head: dict[str, JSON], body: ChatCompletionRequest) -> None:
        self.index = index
        self.head = head
        self.body = body
        self.pending: list[TokenLogprob] = []

    def chunk(
        self, delta: dict[str, JSON], finish: str | None = None, logprobs: JSON = None
    ) -> str:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs}
        return sse({**self.head, "choices": [{**choice, "finish_reason": finish}]})

    def feed(self, event: Event) -> str | None:
        """The chunk for one of this choice's events, if it makes one."""
        body = self.body
        if isinstance(event, Logprobs):
            self.pending.extend(event.items)
        elif isinstance(event, ReasoningDelta):
            return self.chunk({"reasoning_content": event.text, "reasoning": event.text})
        elif isinstance(event, ContentDelta):
            logprobs = _logprobs(self.pending, body) if body.logprobs else None
            self.pending = []
            return self.chunk({"content": event.text}, logprobs=logprobs)
        elif isinstance(event, ToolCallStarted):
            call = {
                "index": event.index,
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
            return self.chunk({"tool_calls": [call]})
        elif isinstance(event, ToolCallDelta):
            call = {"index": event.index, "function": {"arguments": event.arguments}}
            return self.chunk({"tool_calls": [call]})
        elif isinstance(event, Finished):
            logprobs = _logprobs(self.pending, body) if body.logprobs and self.pending else None
            return self.chunk({}, event.reason, logprobs)
        return None


def _head(choices: Choices, obj: str) -> dict[str, JSON]:
    return {
        "id": "chatcmpl-" + choices.id,
        "object": obj,
        "created": choices.created,
        "model": choices.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def _call(call: ToolCall) -> dict[str, JSON]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _logprobs(items: list[TokenLogprob], body: ChatCompletionRequest) -> dict[str, JSON]:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
    n = body.top_logprobs or 0
    return {
        "content": [
            {
                **_token(item.token, item.logprob),
                "top_logprobs": [_token(t, lp) for t, lp in item.top[:n]],
            }
            for item in items
        ],
        "refusal": None,
    }


def _token(raw: bytes, logprob: float) -> dict[str, JSON]:
    return {"token": token_text(raw), "logprob": finite(logprob), "bytes": list(raw)}


def token_text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def finite(logprob: float) -> float:
    """JSON has no -Infinity: a vanishing probability is reported as -9999 as OpenAI does."""
    return logprob if logprob > -9999.0 else -9999.0


def usage(u: Usage) -> dict[str, JSON]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def sse(payload: dict[str, JSON]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
