"""An Ollama `/api/chat` or `/api/generate` body as the one internal ChatRequest.

* Tool calls carry their arguments as JSON objects (as Ollama sends and takes them); calls in
  the history often come without ids, and tool results answer by `tool_name` or not at all, so
  each result is matched to the earliest unanswered call of its name (else the earliest
  unanswered call), and calls without an id are given one.
* `think`: absent turns reasoning on for a model that has it, as Ollama does; `true` or a
  level on a model without it is Ollama's 400 "... does not support thinking".
* `format`: "json" is any JSON object, an object is a JSON Schema (the grammar path compiles
  it; one it cannot is a 400 there).
* `/api/generate` without `raw` is one user turn (after `system`) through the chat template.
* `images` (base64, on a message or a generate body) are read before the model loads
  (`read_images`) and go before the turn's text, as Ollama places them; a `raw`, `suffix` or
  `template` generate takes none.
"""

from __future__ import annotations

import json

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.ollama_schemas import ChatBody, GenerateBody, OllamaMessage, Options
from mlx_kvserve.chat import (
    ChatRequest,
    Message,
    OutputFormat,
    Sampling,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
)
from mlx_kvserve.images import Image
from mlx_kvserve.images.reader import ImageReader
from mlx_kvserve.json_value import JSON

# {index of the message: its images}; for /api/generate the prompt's images are under 0
Images = dict[int, list[Image]]


def read_images(body: ChatBody | GenerateBody, reader: ImageReader) -> Images:
    """Every image of the body, decoded (a 400 naming the first bad one)."""
    if isinstance(body, GenerateBody):
        if body.images and (body.raw or body.suffix or body.template):
            why = "raw mode" if body.raw else "a `suffix` or `template` prompt"
            raise APIError(400, f"{why} does not support images", param="images")
        given = {0: (body.images or [], "images")}
    else:
        given = {i: (m.images or [], f"messages[{i}].images") for i, m in enumerate(body.messages)}
    return {
        i: [reader.from_base64(data, f"{where}[{k}]") for k, data in enumerate(items)]
        for i, (items, where) in given.items()
        if items
    }


def chat_request(
    body: ChatBody, options: Options, *, thinks: bool, images: Images | None = None
) -> ChatRequest:
    """The internal request for `/api/chat` (`thinks`: the model has a reasoning section)."""
    tools = [
        Tool(t.function.name, t.function.description, t.function.parameters or {"type": "object"})
        for t in body.tools or []
    ]
    return ChatRequest(
        messages=_messages(body.messages, images or {}),
        tools=tools,
        tool_choice=ToolChoice("auto" if tools else "none"),
        output=output_format(body.format),
        sampling=sampling(options, body.logprobs, body.top_logprobs),
        thinking=thinking(body.think, thinks, body.model),
    )


def generate_request(
    body: GenerateBody, options: Options, *, thinks: bool, images: Images | None = None
) -> ChatRequest:
    """The internal request for `/api/generate` without `raw`: `system`, then the prompt as
    the user's turn, through the model's template."""
    messages = [Message("system", body.system)] if body.system else []
    messages.append(Message.from_parts("user", [*(images or {}).get(0, []), body.prompt]))
    return ChatRequest(
        messages=messages,
        output=output_format(body.format),
        sampling=sampling(options, body.logprobs, body.top_logprobs),
        thinking=thinking(body.think, thinks, body.model),
    )


def sampling(options: Options, logprobs: bool, top_logprobs: int) -> Sampling:
    return Sampling(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        seed=options.seed,
        max_tokens=options.num_predict,
        stop=options.stop,
        logprobs=logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs,
        speculative=options.speculative,
    )


def thinking(think: bool | str | None, thinks: bool, model: str) -> Thinking:
    """Ollama's `think` onto the reasoning switch."""
    if think is None:
        return Thinking(enabled=True) if thinks else Thinking()
    if think is False:
        return Thinking(enabled=False)
    if not thinks:
        raise APIError(400, f"{json.dumps(model)} does not support thinking", param="think")
    if think is True:
        return Thinking(enabled=True)
    return Thinking(enabled=True, effort=think)  # type: ignore[arg-type]  # a checked level


def output_format(fmt: str | dict[str, JSON] | None) -> OutputFormat:
    if fmt is None or fmt == "":
        return OutputFormat()
    if fmt == "json":
        return OutputFormat("json_object")
    if isinstance(fmt, dict):
        return OutputFormat("json_schema", fmt, "format")
    raise APIError(
        400, f'invalid format {fmt[:40]!r}: give "json" or a JSON Schema object', param="format"
    )


def _messages(given: list[OllamaMessage], images: Images) -> list[Message]:
    out: list[Message] = []
    unanswered: list[ToolCall] = []
    for i, m in enumerate(given):
        content = m.content or ""
        parts = [*images.get(i, []), content]
        if i in images and m.role not in ("user", "tool"):
            where = f"messages[{i}].images"
            raise APIError(400, f"{where}: only user and tool messages carry images", param=where)
        if m.role == "assistant":
            calls = [
                _call(c.id, c.function.name, c.function.arguments, i, j)
                for j, c in enumerate(m.tool_calls or [])
            ]
            message = Message("assistant", content, calls)
            message.reasoning = m.thinking or None
            unanswered.extend(calls)
            out.append(message)
        elif m.role == "tool":
            call = _answered(m, unanswered, i)
            out.append(Message.from_parts("tool", parts, tool_call_id=call, name=m.tool_name))
        else:
            out.append(Message.from_parts(m.role, parts))
    return out


def _call(call_id: str | None, name: str, arguments: dict[str, JSON] | str, i: int, j: int):
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call_id or f"call_{i}_{j}", name, text)


def _answered(m: OllamaMessage, unanswered: list[ToolCall], i: int) -> str:
    """The id of the call a tool result answers (and that call is answered from now on)."""
    if m.tool_call_id:
        match = next((c for c in unanswered if c.id == m.tool_call_id), None)
        if match is not None:
            unanswered.remove(match)
        return m.tool_call_id  # an unknown id: the history check names it
    match = next((c for c in unanswered if c.name == m.tool_name), None) if m.tool_name else None
    match = match or (unanswered[0] if unanswered else None)
    if match is None:
        raise APIError(
            400,
            f"messages[{i}]: a tool result, but no earlier assistant message made a tool call "
            "it could answer",
            param=f"messages[{i}]",
        )
    unanswered.remove(match)
    return match.id
