"""POST /v1/responses: the OpenAI Responses protocol, stateless.

Codex and the OpenAI Agents SDK's default model speak this. `input` items become the internal
conversation (`function_call` items become tool calls, `function_call_output` items tool
messages, reasoning items are dropped); the output is `message` and `function_call` items, and
the stream is the documented event sequence. Nothing is stored, so `previous_response_id` and
`store: true` are refused with a 400 that says so.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import Failed, Finished, Generation, Usage, start_chat
from mlx_kvserve.api.openai_responses_schemas import InputItem, ResponsesRequest
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

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def responses(request: Request) -> Response:
    settings = request.app.state.settings
    body = parse(ResponsesRequest, await read_json(request, settings.max_body_bytes))
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server is stateless and stores no "
            "responses; send the whole conversation in 'input'.",
            param="previous_response_id",
        )
    if body.store:
        raise APIError(
            400,
            "store: true is not supported: this server is stateless and stores no responses.",
            param="store",
        )
    generation = await start_chat(request, to_chat_request(body), model=body.model)
    shape = _Shape(generation, body)
    if body.stream:
        events = _stream(generation, shape, settings.keepalive_seconds)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    result = await generation.result(request)
    output: list[dict[str, Any]] = []
    if result.content or not result.calls:
        output.append(shape.message_item(result.content, "completed"))
    output += [shape.call_item(c.id, c.name, c.arguments, "completed") for c in result.calls]
    return JSONResponse(shape.response(output, result.finished))


def to_chat_request(body: ResponsesRequest) -> ChatRequest:
    messages: list[Message] = []
    if body.instructions:
        messages.append(Message("system", body.instructions))
    items = (
        [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    )
    for i, item in enumerate(items):
        _add_item(messages, item, i)
    tools = [
        Tool(t.name, t.description, t.parameters or {"type": "object"}) for t in body.tools or []
    ]
    return ChatRequest(
        messages,
        tools,
        _tool_choice(body, tools),
        _output_format(body),
        Sampling(temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_output_tokens),
    )


def _add_item(messages: list[Message], item: InputItem, i: int) -> None:
    if item.type == "message":
        if item.role is None:
            raise APIError(400, f"input[{i}]: a message needs a 'role'.", param=f"input[{i}].role")
        role = "system" if item.role == "developer" else item.role
        messages.append(Message(role, item.text(item.content)))
    elif item.type == "function_call":
        if not item.call_id or not item.name:
            raise APIError(
                400, f"input[{i}]: a function_call needs 'call_id' and 'name'.", param=f"input[{i}]"
            )
        call = ToolCall(item.call_id, item.name, item.arguments or "{}")
        where = f"input[{i}]"
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls.append(call)  # an answer and the calls after it form one turn
            last.origin = last.origin or where
        else:
            messages.append(Message("assistant", "", [call], origin=where))
    elif item.type == "function_call_output":
        if not item.call_id:
            raise APIError(
                400, f"input[{i}]: a function_call_output needs 'call_id'.", param=f"input[{i}]"
            )
        messages.append(
            Message("tool", item.text(item.output), tool_call_id=item.call_id, origin=f"input[{i}]")
        )
    # "reasoning" items carry no text these templates re-render


def _tool_choice(body: ResponsesRequest, tools: list[Tool]) -> ToolChoice:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        mode = choice or ("auto" if tools else "none")
        if mode == "required" and not tools:
            raise APIError(
                400, "tool_choice 'required' needs at least one tool.", param="tool_choice"
            )
        return ToolChoice(mode, parallel=body.parallel_tool_calls)
    if choice.name not in {t.name for t in tools}:
        raise APIError(
            400,
            f"tool_choice names the function {choice.name!r}, which is not among the tools.",
            param="tool_choice",
        )
    return ToolChoice("function", choice.name, parallel=False)


def _output_format(body: ResponsesRequest) -> OutputFormat:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return OutputFormat()
    if fmt.type == "json_object":
        return OutputFormat("json_object")
    return OutputFormat("json_schema", fmt.schema_ or {"type": "object"}, fmt.name)


class _Shape:
    """The fixed parts of one response, and its items."""

    def __init__(self, generation: Generation, body: ResponsesRequest) -> None:
        self.id = "resp_" + generation.id
        self.message_id = "msg_" + generation.id
        self.created = int(time.time())
        self.model = generation.model
        self.body = body

    def response(
        self, output: list[dict[str, Any]], finished: Finished | None, status: str | None = None
    ) -> dict[str, Any]:
        body = self.body
        incomplete = finished is not None and finished.reason == "length"
        if status is None:
            status = "incomplete" if incomplete else "completed"
        fmt = (
            body.text.format.model_dump(by_alias=True, exclude_none=True)
            if body.text and body.text.format
            else {"type": "text"}
        )
        choice = body.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": body.temperature,
            "text": {"format": fmt},
            "tool_choice": choice.model_dump()
            if choice is not None and not isinstance(choice, str)
            else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage(finished.usage) if finished is not None else None,
            "metadata": body.metadata or {},
        }

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [_text_part(text)]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": "fc_" + call_id.removeprefix("call_"),
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def _stream(generation: Generation, shape: _Shape, keepalive: float) -> AsyncIterator[str]:
    seq = 0

    def sse(kind: str, payload: dict[str, Any]) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **payload}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    output: list[dict[str, Any]] = []
    text: str | None = None  # the open message's text, when a message item is open
    call: dict[str, Any] | None = None  # the open function_call item

    def close_open() -> list[str]:
        nonlocal text, call
        out = []
        index = len(output)
        if text is not None:
            part = _text_part(text)
            ids = {"item_id": shape.message_id, "output_index": index, "content_index": 0}
            out.append(sse("response.output_text.done", {**ids, "text": text, "logprobs": []}))
            out.append(sse("response.content_part.done", {**ids, "part": part}))
            item = shape.message_item(text, "completed")
            out.append(sse("response.output_item.done", {"output_index": index, "item": item}))
            output.append(item)
            text = None
        if call is not None:
            ids = {"item_id": call["id"], "output_index": index}
            out.append(
                sse(
                    "response.function_call_arguments.done",
                    {**ids, "name": call["name"], "arguments": call["arguments"]},
                )
            )
            call["status"] = "completed"
            out.append(sse("response.output_item.done", {"output_index": index, "item": call}))
            output.append(call)
            call = None
        return out

    yield sse("response.created", {"response": shape.response([], None, "in_progress")})
    yield sse("response.in_progress", {"response": shape.response([], None, "in_progress")})
    async for event in generation.events(keepalive):
        if event is None:
            yield ": keep-alive\n\n"
        elif isinstance(event, ContentDelta):
            if text is None:
                for line in close_open():
                    yield line
                text = ""
                index = len(output)
                yield sse(
                    "response.output_item.added",
                    {"output_index": index, "item": shape.message_item("", "in_progress")},
                )
                yield sse(
                    "response.content_part.added",
                    {
                        "item_id": shape.message_id,
                        "output_index": index,
                        "content_index": 0,
                        "part": _text_part(""),
                    },
                )
            text += event.text
            yield sse(
                "response.output_text.delta",
                {
                    "item_id": shape.message_id,
                    "output_index": len(output),
                    "content_index": 0,
                    "delta": event.text,
                    "logprobs": [],
                },
            )
        elif isinstance(event, ToolCallStarted):
            for line in close_open():
                yield line
            call = shape.call_item(event.id, event.name, "", "in_progress")
            yield sse(
                "response.output_item.added", {"output_index": len(output), "item": dict(call)}
            )
        elif isinstance(event, ToolCallDelta) and call is not None:
            call["arguments"] += event.arguments
            yield sse(
                "response.function_call_arguments.delta",
                {"item_id": call["id"], "output_index": len(output), "delta": event.arguments},
            )
        elif isinstance(event, Finished):
            for line in close_open():
                yield line
            final = shape.response(output, event)
            kind = (
                "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            )
            yield sse(kind, {"response": final})
        elif isinstance(event, Failed):
            yield sse("error", {"code": "server_error", "message": event.message, "param": None})


def usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
