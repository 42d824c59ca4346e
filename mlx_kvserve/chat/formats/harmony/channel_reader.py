"""gpt-oss's harmony output as protocol-neutral events, as it streams (chat.formats.harmony).

The generation prompt ends in `<|start|>assistant`, so the model starts with a message header:
`<|channel|>analysis<|message|>` (its reasoning), `<|channel|>final<|message|>` (the answer),
`<|channel|>commentary<|message|>` (a preamble the user sees), or a call, which gpt-oss writes
either way round, ` to=functions.NAME<|channel|>commentary json<|message|>` (as its template
renders calls) or `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`. A
message ends at `<|end|>` (another `<|start|>` header follows), `<|return|>` or `<|call|>`.

Channels become events: analysis is `ReasoningDelta`s; final and commentary text is content;
a call is announced once its header is complete and its body, the JSON arguments, is passed on
as it arrives (the deltas concatenate to the call's arguments). Control tokens never reach
content, reasoning or arguments, whatever the model writes. Text without a header (a model that
does not keep to the format) is content. Message texts are kept exactly as written, since the
template replays a tool-call turn's analysis as `<|message|>` + reasoning + `<|end|>`.
"""

from __future__ import annotations

import json
import logging
import re

from mlx_kvserve.chat.events import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from mlx_kvserve.chat.formats.harmony import channels
from mlx_kvserve.chat.freeform import input_from_arguments
from mlx_kvserve.chat.request import Tool, ToolCall, new_call_id

log = logging.getLogger("mlx_kvserve.chat")

_CHANNEL = re.compile(re.escape(channels.CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HEAD_STARTS = (channels.CHANNEL, " to=", "to=", channels.CONSTRAIN)
_ROLE = re.compile(r"[A-Za-z_]*")
MAX_HEADER = 512  # characters: longer "headers" are text that does not keep to the format
_STOPS = (*channels.ENDS, channels.END, channels.START, channels.CHANNEL)


class HarmonyParser:
    """Splits streamed harmony text into reasoning, content and tool-call events (the
    interface of chat.output.OutputParser)."""

    def __init__(
        self, tools: list[Tool] | None = None, *, parse_calls: bool = True, id_prefix: str = "call_"
    ) -> None:
        self.parse_calls = parse_calls
        self.custom = {t.name for t in tools or [] if t.is_custom}
        self.id_prefix = id_prefix
        self.calls: list[ToolCall] = []
        self.content = ""
        self.reasoning = ""
        self._pending = ""
        self._state = "header"  # "header" | "body" | "between" | "done"
        self._head = ""
        self._kind = ""  # the open message: "reasoning" | "content" | "call" | "drop"
        self._call: tuple[str, str] | None = None  # (id, name) of the open call
        self._args = ""  # the open call's arguments, as passed on
        self._blank = ""  # its trailing whitespace, held back
        self._seen = {"reasoning": False, "content": False}
        self._sep = False  # the open message follows another of its kind: a blank line first

    def feed(self, text: str) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        self._pending += text
        while self._pending and self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[OutputEvent]:
        """End of generation: pass on held text, close a call the model left open."""
        events: list[OutputEvent] = []
        if self._state == "header":  # a header held back, whole or not: decide on it now
            self._pending, self._head = self._head + self._pending, ""
        while self._pending and self._step(events, final=True):
            pass
        if self._state == "body":
            self._route(_clean(self._pending), events)
            self._close(events)
        self._pending = ""
        self._state = "done"
        return events

    # ----------------------------------------------------------------------------------------
    def _step(self, events: list[OutputEvent], *, final: bool) -> bool:
        """Consume what can be consumed; False when more text is needed."""
        if self._state == "done":
            self._pending = ""
            return False
        if self._state == "between":
            at = self._pending.find(channels.START)
            if at < 0:
                keep = _partial(self._pending, (channels.START,))
                self._pending = self._pending[len(self._pending) - keep :] if keep else ""
                return False
            self._pending = self._pending[at + len(channels.START) :]
            self._state, self._head = "header", ""
            return True
        if self._state == "header":
            return self._scan_header(events, final=final)
        return self._scan_body(events, final=final)

    def _scan_header(self, events: list[OutputEvent], *, final: bool) -> bool:
        head = self._head + self._pending
        at = head.find(channels.MESSAGE)
        ended = [i for t in channels.ENDS + (channels.END,) if (i := head.find(t)) >= 0]
        header = 0 <= at <= MAX_HEADER and _could_be_header(head[:at])
        if header and not any(i < at for i in ended):
            self._pending = head[at + len(channels.MESSAGE) :]
            self._head = ""
            self._open(head[:at], events)
            return True
        if not (final or ended) and len(head) <= MAX_HEADER and _partial(head, channels.CONTROL):
            self._head, self._pending = head, ""  # a control token may be arriving: wait
            return False
        if ended or len(head) > MAX_HEADER or not _could_be_header(head):
            if ended and _could_be_header(head[: min(ended)]):
                # a header cut off by an end token: nothing to show
                self._pending, self._head = head[min(ended) :], ""
                self._state = "between"
                return True
            self._pending, self._head = head, ""  # text without a header: the answer
            self._start("content", events)
            self._state = "body"
            return True
        self._head, self._pending = head, ""
        return False

    def _open(self, header: str, events: list[OutputEvent]) -> None:
        """A message's header is complete: route its body by channel and recipient."""
        self._state = "body"
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None:
            if not self.parse_calls:
                self._kind = "drop"
                return
            name = recipient.group(1).removeprefix(channels.FUNCTIONS)
            self._kind = "call"
            self._call = (new_call_id(self.id_prefix), name)
            self._args, self._blank = "", ""
            if name not in self.custom:  # a custom tool's raw input is sent whole at the end
                events.append(ToolCallStarted(len(self.calls), self._call[0], name))
            return
        analysis = channel is not None and channel.group(1) == "analysis"
        self._start("reasoning" if analysis else "content", events)

    def _start(self, kind: str, events: list[OutputEvent]) -> None:
        self._kind = kind
        self._sep = self._seen.get(kind, False)

    def _scan_body(self, events: list[OutputEvent], *, final: bool) -> bool:
        found = [(i, t) for t in _STOPS if (i := self._pending.find(t)) >= 0]
        if not found:
            keep = 0 if final else _partial(self._pending, channels.CONTROL)
            text = self._pending[: len(self._pending) - keep]
            self._route(_clean(text), events)
            self._pending = self._pending[len(text) :]
            return False
        at, token = min(found)
        self._route(_clean(self._pending[:at]), events)
        self._close(events)
        if token == channels.END:
            self._pending, self._state = self._pending[at + len(token) :], "between"
        elif token == channels.START:
            self._pending, self._state, self._head = self._pending[at + len(token) :], "header", ""
        elif token == channels.CHANNEL:  # a new header without <|end|><|start|>
            self._pending, self._state, self._head = self._pending[at:], "header", ""
        else:
            self._pending, self._state = "", "done"
        return True

    def _route(self, text: str, events: list[OutputEvent]) -> None:
        if not text:
            return
        kind = self._kind
        if kind == "call":
            assert self._call is not None
            if not self._args:
                text = text.lstrip()
            text = self._blank + text
            body = text.rstrip()
            self._blank = text[len(body) :]
            if body:
                self._args += body
                if self._call[1] not in self.custom:
                    events.append(ToolCallDelta(len(self.calls), body))
            return
        if kind not in ("reasoning", "content"):
            return
        if self._sep:
            text, self._sep = "\n\n" + text, False
        self._seen[kind] = True
        if kind == "reasoning":
            self.reasoning += text
            events.append(ReasoningDelta(text))
        else:
            self.content += text
            events.append(ContentDelta(text))

    def _close(self, events: list[OutputEvent]) -> None:
        """The open message ended: finish its call, if it is one."""
        if self._kind == "call" and self._call is not None:
            call_id, name = self._call
            index = len(self.calls)
            try:
                arguments = json.loads(self._args or "{}")
            except json.JSONDecodeError:
                log.warning("the model wrote call arguments that are not JSON: %.200r", self._args)
                arguments = None
            if name in self.custom:
                raw = self._args if arguments is None else arguments
                done = ToolCall(call_id, name, input_from_arguments(raw), "custom")
                events.append(ToolCallStarted(index, call_id, name))
                events.append(ToolCallDelta(index, done.arguments))
            else:
                done = ToolCall(call_id, name, self._args or "{}", "function")
                if not self._args:
                    events.append(ToolCallDelta(index, "{}"))
            self.calls.append(done)
            events.append(ToolCallFinished(index, done))
        self._call, self._kind = None, ""


def _could_be_header(text: str) -> bool:
    """`text` is, or may grow into, a message header (a role word, then a channel or a
    recipient)."""
    role = _ROLE.match(text)
    for rest in (text, text[role.end() :] if role else text):
        if not rest or any(rest.startswith(s) or s.startswith(rest) for s in _HEAD_STARTS):
            return True
    return False


def _clean(text: str) -> str:
    for token in channels.CONTROL:
        text = text.replace(token, "")
    return text


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
