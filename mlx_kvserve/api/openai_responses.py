"""POST /v1/responses: the OpenAI Responses protocol, stateless, as Codex speaks it.

Codex and the OpenAI Agents SDK's default model speak this. `input` items become the internal
conversation: `developer` and `system` messages system turns, `function_call` and
`custom_tool_call` items tool calls, their `*_output` items tool messages, and `reasoning` items
the reasoning of the assistant turn they precede (the exact sampled text when their
`encrypted_content` is a seal this server made, else their visible text). Tools: see
`responses_tools`; output: see `responses_output`. Nothing is stored, so `previous_response_id`
and `store: true` are refused with a 400 that says so.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlx_kvserve.api.body import read_json
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import start_chat
from mlx_kvserve.api.images import image_reader
from mlx_kvserve.api.openai_responses_schemas import ContentPart, InputItem, Part, ResponsesRequest
from mlx_kvserve.api.reading import Failed, Finished, Generation
from mlx_kvserve.api.responses_output import ResponseEvents, Shape, StreamEvent, usage
from mlx_kvserve.api.responses_tools import ToolSet, flat_name, parse_tools, tool_choice
from mlx_kvserve.api.schemas import parse
from mlx_kvserve.api.seal import reasoning_seal
from mlx_kvserve.chat import ChatRequest, Message, OutputFormat, Sampling, Thinking, ToolCall
from mlx_kvserve.chat.reasoning.reasoning_seal import ReasoningSeal
from mlx_kvserve.images import Image
from mlx_kvserve.images.reader import ImageReader

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

__all__ = ["responses", "to_chat_request", "usage"]


async def responses(request: Request) -> Response:
    """OpenAI Responses, stateless, as Codex and the Agents SDK send it: input items,
    function, custom and namespace tools, reasoning items; streamed or one body."""
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
    seal = reasoning_seal(request)
    # Off the event loop: a custom tool's grammar is compiled to check it, images decode.
    tools = await run_in_threadpool(parse_tools, body)
    chat = await run_in_threadpool(to_chat_request, body, tools, seal, image_reader(request))
    generation = await start_chat(request, chat, model=body.model)
    shape = Shape(generation.id, generation.model, body, tools, seal)
    if body.stream:
        events = _stream(generation, shape, settings.keepalive_seconds)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    result = await generation.result(request)
    output = shape.output(result.reasoning, result.content, result.calls)
    return JSONResponse(shape.response(output, result.finished))


def to_chat_request(
    body: ResponsesRequest,
    tools: ToolSet | None = None,
    seal: ReasoningSeal | None = None,
    images: ImageReader | None = None,
) -> ChatRequest:
    """The internal request (`images`: the server's reader; by default inline images only)."""
    tools = tools if tools is not None else parse_tools(body)
    messages: list[Message] = []
    if body.instructions:
        messages.append(Message("system", body.instructions))
    items = (
        [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    )
    history = _History(messages, tools, seal, images or ImageReader())
    for i, item in enumerate(items):
        history.add(item, i)
    effort = body.reasoning.effort if body.reasoning else None
    return ChatRequest(
        messages,
        tools.tools,
        tool_choice(body, tools),
        _output_format(body),
        Sampling(
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            max_tokens=body.max_output_tokens,
            ignore_eos=body.ignore_eos,
            speculative=body.speculative,
        ),
        Thinking(enabled=False if effort == "none" else None, effort=effort),
    )


class _History:
    """Input items into messages; a reasoning item waits for the assistant turn it precedes."""

    def __init__(
        self,
        messages: list[Message],
        tools: ToolSet,
        seal: ReasoningSeal | None,
        images: ImageReader,
    ) -> None:
        self.messages = messages
        self.tools = tools
        self.seal = seal
        self.images = images
        self.reasoning: list[str] = []

    def add(self, item: InputItem, i: int) -> None:
        where = f"input[{i}]"
        if item.type == "reasoning":
            self.reasoning.append(self._reasoning_text(item))
        elif item.type == "message":
            if item.role is None:
                raise APIError(400, f"{where}: a message needs a 'role'.", param=f"{where}.role")
            role = "system" if item.role == "developer" else item.role
            parts = self._parts(item.content, f"{where}.content", role == "user")
            message = Message.from_parts(role, parts)
            if role == "assistant":
                self._take_reasoning(message)
            else:
                self.reasoning.clear()  # reasoning not followed by the model's turn is moot
            self.messages.append(message)
        elif item.type in {"function_call", "custom_tool_call"}:
            self._call(item, where)
        else:  # function_call_output, custom_tool_call_output
            if not item.call_id:
                raise APIError(
                    400, f"{where}: a {item.type} needs 'call_id'.", param=f"{where}.call_id"
                )
            self.reasoning.clear()
            parts = self._parts(item.output, f"{where}.output", True)
            self.messages.append(
                Message.from_parts("tool", parts, tool_call_id=item.call_id, origin=where)
            )

    def _parts(self, value: str | list[Part] | None, where: str, images: bool) -> list[str | Image]:
        """Text and `input_image` parts in order; images only from the user and tool outputs."""
        if not isinstance(value, list):
            return [value or ""]
        parts: list[str | Image] = []
        for j, part in enumerate(value):
            if isinstance(part, ContentPart):
                parts.append(part.text or part.refusal or "")
                continue
            field = f"{where}[{j}]"
            if not images:
                raise APIError(400, f"{field}: only user messages carry images.", param=field)
            if part.image_url is None:
                why = "file_id is not supported: nothing is uploaded to this server"
                why = why if part.file_id is not None else "an input_image needs 'image_url'"
                raise APIError(400, f"{field}: {why}.", param=f"{field}.image_url")
            parts.append(self.images.from_url(part.image_url, f"{field}.image_url"))
        return parts

    def _call(self, item: InputItem, where: str) -> None:
        custom = item.type == "custom_tool_call"
        if not item.call_id or not item.name:
            raise APIError(400, f"{where}: a {item.type} needs 'call_id' and 'name'.", param=where)
        if custom and item.input is None:
            raise APIError(400, f"{where}: a custom_tool_call needs 'input'.", param=where)
        name = flat_name(item.namespace, item.name) if item.namespace else item.name
        if custom:
            call = ToolCall(item.call_id, name, item.input or "", "custom")
        else:
            call = ToolCall(item.call_id, name, item.arguments or "{}")
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant" and not self.reasoning:
            last.tool_calls.append(call)  # an answer and the calls after it form one turn
            last.origin = last.origin or where
        else:
            message = Message("assistant", "", [call], origin=where)
            self._take_reasoning(message)
            self.messages.append(message)

    def _take_reasoning(self, message: Message) -> None:
        if self.reasoning:
            message.reasoning = "".join(self.reasoning) or None  # nothing visible: none
            self.reasoning.clear()

    def _reasoning_text(self, item: InputItem) -> str:
        """The exact sampled text when the seal opens; else the visible text (content, or the
        summary when the content was left out). A foreign or tampered seal is never trusted."""
        if item.encrypted_content is not None and self.seal is not None:
            opened = self.seal.open(item.encrypted_content)
            if opened is not None:
                return opened
        return item.text(item.content) or item.text(item.summary)


def _output_format(body: ResponsesRequest) -> OutputFormat:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return OutputFormat()
    if fmt.type == "json_object":
        return OutputFormat("json_object")
    return OutputFormat("json_schema", fmt.schema_ or {"type": "object"}, fmt.name)


async def _stream(generation: Generation, shape: Shape, keepalive: float) -> AsyncIterator[str]:
    seq = 0

    def sse(events: list[StreamEvent]) -> str:
        nonlocal seq
        lines = []
        for kind, payload in events:
            data = {"type": kind, "sequence_number": seq, **payload}
            seq += 1
            lines.append(f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n")
        return "".join(lines)

    machine = ResponseEvents(shape)
    yield sse(machine.start())
    async for event in generation.events(keepalive):
        if event is None:
            yield ": keep-alive\n\n"
        elif isinstance(event, Finished):
            yield sse(machine.finish(event))
        elif isinstance(event, Failed):
            error = {"code": "server_error", "message": event.message, "param": None}
            yield sse([("error", error)])
        else:
            text = sse(machine.feed(event))
            if text:
                yield text
