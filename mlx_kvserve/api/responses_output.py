"""What /v1/responses sends back: output items, and the stream's documented event sequence.

`ResponseEvents` is a pure state machine (no I/O): fed the generation's output events, it returns
the Responses stream events to send, as (type, payload) pairs, and collects the finished output
items. Items come in the order the model wrote them: a `reasoning` item (when the model reasoned),
the `message`, then `function_call` / `custom_tool_call` items (`namespace` set for a namespaced
tool's function).

A reasoning item carries the text as `content` (`reasoning_text`), as a `summary_text` when the
request asked for a summary, and, when `include` has `reasoning.encrypted_content`, the exact
sampled text sealed (`ReasoningSeal`) as `encrypted_content`, which the server opens again when
the client replays the item, so the next turn renders token for token as generated.
"""

from __future__ import annotations

import time

from mlx_kvserve.api.openai_responses_schemas import ResponsesRequest
from mlx_kvserve.api.reading import Event, Finished, Usage
from mlx_kvserve.api.responses_tools import ToolSet
from mlx_kvserve.chat import ToolCall
from mlx_kvserve.chat.events import ContentDelta, ReasoningDelta, ToolCallDelta, ToolCallStarted
from mlx_kvserve.chat.reasoning.reasoning_seal import ReasoningSeal
from mlx_kvserve.json_value import JSON

StreamEvent = tuple[str, dict[str, JSON]]


class Shape:
    """The fixed parts of one response, and its items."""

    def __init__(
        self,
        generation_id: str,
        model: str,
        body: ResponsesRequest,
        tools: ToolSet,
        seal: ReasoningSeal | None,
    ) -> None:
        self.id = "resp_" + generation_id
        self.message_id = "msg_" + generation_id
        self.reasoning_id = "rs_" + generation_id
        self.created = int(time.time())
        self.model = model
        self.body = body
        self.tools = tools
        self.seal = seal if body.encrypted_reasoning else None
        reasoning = body.reasoning
        self.summary = bool(reasoning and (reasoning.summary or reasoning.generate_summary))

    def response(
        self, output: list[dict[str, JSON]], finished: Finished | None, status: str | None = None
    ) -> dict[str, JSON]:
        body = self.body
        incomplete = finished is not None and finished.reason == "length"
        if status is None:
            status = "incomplete" if incomplete else "completed"
        fmt = (
            body.text.format.model_dump(by_alias=True, exclude_none=True)
            if body.text and body.text.format
            else {"type": "text"}
        )
        reasoning = body.reasoning
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
            "reasoning": {
                "effort": reasoning.effort if reasoning else None,
                "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None,
            },
            "store": False,
            "temperature": body.temperature,
            "text": {"format": fmt},
            "tool_choice": body.tool_choice or "auto",
            "tools": list(body.tools or []),
            "top_p": body.top_p,
            "truncation": body.truncation or "disabled",
            "usage": usage(finished.usage) if finished else None,
            "metadata": body.metadata or {},
        }

    def message_item(self, text: str, status: str) -> dict[str, JSON]:
        content = [] if status == "in_progress" else [_text_part(text)]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def reasoning_item(self, text: str, status: str) -> dict[str, JSON]:
        done = status != "in_progress"
        item: dict[str, JSON] = {
            "type": "reasoning",
            "id": self.reasoning_id,
            "status": status,
            "summary": [{"type": "summary_text", "text": text}] if done and self.summary else [],
            "content": [{"type": "reasoning_text", "text": text}] if done else [],
        }
        if done and self.seal is not None:
            item["encrypted_content"] = self.seal.seal(text)
        return item

    def call_item(self, call_id: str, flat: str, payload: str, status: str) -> dict[str, JSON]:
        """A function_call, or a custom_tool_call for a custom tool (`payload`: the arguments or
        the raw input), with `namespace` apart for a namespaced tool's call."""
        namespace, name = self.tools.wire(flat)
        suffix = call_id.removeprefix("call_")
        if self.tools.is_custom(flat):
            item = {"type": "custom_tool_call", "id": "ctc_" + suffix, "call_id": call_id}
            item.update({"name": name, "input": payload, "status": status})
        else:
            item = {"type": "function_call", "id": "fc_" + suffix, "call_id": call_id}
            item.update({"name": name, "arguments": payload, "status": status})
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def output(self, reasoning: str, content: str, calls: list[ToolCall]) -> list[dict[str, JSON]]:
        """The output items of a whole (non-streamed) answer."""
        items: list[dict[str, JSON]] = []
        if reasoning:
            items.append(self.reasoning_item(reasoning, "completed"))
        if content or not calls:
            items.append(self.message_item(content, "completed"))
        items += [self.call_item(c.id, c.name, c.arguments, "completed") for c in calls]
        return items


def _text_part(text: str) -> dict[str, JSON]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(u: Usage) -> dict[str, JSON]:
    """Responses usage. Cache writes when the generation counted them (else 0: the engine does
    not report them yet)."""
    written = getattr(u, "cache_write_tokens", 0) or 0
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": written},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


class ResponseEvents:
    """Output events in, Responses stream events out (pure: testable with hand-made events)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.output: list[dict[str, JSON]] = []
        self._open: str | None = None  # "reasoning" | "message" | "call"
        self._text = ""
        self._call: dict[str, JSON] | None = None

    def start(self) -> list[StreamEvent]:
        snapshot = {"response": self.shape.response([], None, "in_progress")}
        return [("response.created", snapshot), ("response.in_progress", snapshot)]

    def feed(self, event: Event) -> list[StreamEvent]:
        if isinstance(event, ReasoningDelta):
            return self._reasoning(event.text)
        if isinstance(event, ContentDelta):
            return self._content(event.text)
        if isinstance(event, ToolCallStarted):
            out = self.close()
            self._open = "call"
            self._call = self.shape.call_item(event.id, event.name, "", "in_progress")
            return out + [self._added(dict(self._call))]
        if isinstance(event, ToolCallDelta) and self._call is not None:
            custom = self._call["type"] == "custom_tool_call"
            self._call["input" if custom else "arguments"] += event.arguments
            kind = (
                "response.custom_tool_call_input.delta"
                if custom
                else "response.function_call_arguments.delta"
            )
            return [(kind, {**self._ids(self._call["id"]), "delta": event.arguments})]
        return []

    def finish(self, finished: Finished) -> list[StreamEvent]:
        out = self.close()
        final = self.shape.response(self.output, finished)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + [(kind, {"response": final})]

    # ----------------------------------------------------------------------------------------
    def _ids(self, item_id: str, **more: int) -> dict[str, JSON]:
        return {"item_id": item_id, "output_index": len(self.output), **more}

    def _added(self, item: dict[str, JSON]) -> StreamEvent:
        return ("response.output_item.added", {"output_index": len(self.output), "item": item})

    def _done(self, item: dict[str, JSON]) -> list[StreamEvent]:
        event = ("response.output_item.done", {"output_index": len(self.output), "item": item})
        self.output.append(item)
        return [event]

    def _reasoning(self, delta: str) -> list[StreamEvent]:
        shape = self.shape
        out: list[StreamEvent] = []
        if self._open != "reasoning":
            out += self.close()
            self._open, self._text = "reasoning", ""
            out.append(self._added(shape.reasoning_item("", "in_progress")))
            part = {"type": "reasoning_text", "text": ""}
            ids = self._ids(shape.reasoning_id, content_index=0)
            out.append(("response.content_part.added", {**ids, "part": part}))
            if shape.summary:
                part = {"type": "summary_text", "text": ""}
                ids = self._ids(shape.reasoning_id, summary_index=0)
                out.append(("response.reasoning_summary_part.added", {**ids, "part": part}))
        self._text += delta
        ids = self._ids(shape.reasoning_id, content_index=0)
        out.append(("response.reasoning_text.delta", {**ids, "delta": delta}))
        if shape.summary:
            ids = self._ids(shape.reasoning_id, summary_index=0)
            out.append(("response.reasoning_summary_text.delta", {**ids, "delta": delta}))
        return out

    def _content(self, delta: str) -> list[StreamEvent]:
        shape = self.shape
        out: list[StreamEvent] = []
        if self._open != "message":
            out += self.close()
            self._open, self._text = "message", ""
            out.append(self._added(shape.message_item("", "in_progress")))
            ids = self._ids(shape.message_id, content_index=0)
            out.append(("response.content_part.added", {**ids, "part": _text_part("")}))
        self._text += delta
        ids = self._ids(shape.message_id, content_index=0)
        out.append(("response.output_text.delta", {**ids, "delta": delta, "logprobs": []}))
        return out

    def close(self) -> list[StreamEvent]:
        """Finish the open item, if any."""
        shape, text, kind = self.shape, self._text, self._open
        self._open, self._text = None, ""
        if kind == "reasoning":
            ids = self._ids(shape.reasoning_id, content_index=0)
            part = {"type": "reasoning_text", "text": text}
            out = [("response.reasoning_text.done", {**ids, "text": text})]
            out.append(("response.content_part.done", {**ids, "part": part}))
            if shape.summary:
                ids = self._ids(shape.reasoning_id, summary_index=0)
                part = {"type": "summary_text", "text": text}
                out.append(("response.reasoning_summary_text.done", {**ids, "text": text}))
                out.append(("response.reasoning_summary_part.done", {**ids, "part": part}))
            return out + self._done(shape.reasoning_item(text, "completed"))
        if kind == "message":
            ids = self._ids(shape.message_id, content_index=0)
            out = [("response.output_text.done", {**ids, "text": text, "logprobs": []})]
            out.append(("response.content_part.done", {**ids, "part": _text_part(text)}))
            return out + self._done(shape.message_item(text, "completed"))
        if kind == "call" and self._call is not None:
            call, self._call = self._call, None
            ids = self._ids(call["id"])
            if call["type"] == "custom_tool_call":
                out = [("response.custom_tool_call_input.done", {**ids, "input": call["input"]})]
            else:
                done = {**ids, "name": call["name"], "arguments": call["arguments"]}
                out = [("response.function_call_arguments.done", done)]
            call["status"] = "completed"
            return out + self._done(call)
        return []
