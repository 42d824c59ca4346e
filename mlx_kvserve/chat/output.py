"""The model's text as protocol-neutral output events: content, and tool calls as they form.

`OutputParser` is fed the decoded text as it streams and splits it at the tool format's markers.
Text outside calls is content. Inside a call in a JSON-body format, the call is announced as soon
as its name is complete and its arguments are passed on in fragments as they are generated (mlx-lm
sends each call whole at the end); the finished call is then parsed by mlx-lm's own parser for
the format, and its arguments are exactly the concatenated fragments. A Qwen3-Coder XML or GLM
call is announced once its name is complete and passes on each parameter as it closes; so does
any format with a `CallSyntax` (chat.call_syntax), whose stream may hold several calls per
block. Other formats' calls are parsed by their mlx-lm parser when the closing marker arrives
and sent whole.

A model with reasoning markers (chat.reasoning.thinking) writes its reasoning between them; that
text is `ReasoningDelta`s, never content and never a call, whatever it looks like. The parser starts
inside the reasoning when the prompt opened it (DeepSeek-R1 distills, Qwen3.5/3.6), and enters
it when the model writes the opening marker (Qwen3). Whitespace around the reasoning (the
"\n" after `<think>`, the "\n\n" after `</think>`) belongs to neither part, as the templates
that re-render past reasoning (`<think>\n` + reasoning + `\n</think>\n\n` + answer) have it.
"""

from __future__ import annotations

import json
import logging
import re

from mlx_kvserve.chat.call_syntax import CallFormat
from mlx_kvserve.chat.events import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCallDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from mlx_kvserve.chat.freeform import freeform_name, input_from_arguments, raw_input
from mlx_kvserve.chat.open_call import OpenCall
from mlx_kvserve.chat.reasoning.thinking import ThinkMarkers
from mlx_kvserve.chat.request import Tool, ToolCall, new_call_id
from mlx_kvserve.json_value import JSON

log = logging.getLogger("mlx_kvserve.chat")

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class OutputParser:
    """Splits streamed model text into reasoning, content and tool-call events."""

    def __init__(
        self,
        fmt: CallFormat | None,
        tools: list[Tool] | None = None,
        *,
        parse_calls: bool = True,
        id_prefix: str = "call_",
        markers: ThinkMarkers | None = None,
        reasoning: bool = False,
    ) -> None:
        self.fmt = fmt if parse_calls else None
        self.tools = [t.as_openai() for t in tools or []]
        self.custom = {t.name for t in tools or [] if t.is_custom}
        self.id_prefix = id_prefix
        self.calls: list[ToolCall] = []
        self.content = ""
        self.reasoning = ""
        self.think = markers
        self._in_reasoning = reasoning and markers is not None
        self._trim_reasoning = True  # drop whitespace that opens a reasoning section
        self._trim_content = False  # ... and the whitespace that follows one
        self._pending = ""  # text not yet known to be content or a call's opening
        self._call: OpenCall | None = None

    def feed(self, text: str) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        self._pending += text
        while self._pending:
            if self._in_reasoning:
                if not self._scan_reasoning(events):
                    break
            elif self._call is None:
                if not self._scan_content(events):
                    break
            elif not self._scan_call(events):
                break
        return events

    def finish(self) -> list[OutputEvent]:
        """End of generation: flush held text, close a call the model left open."""
        events: list[OutputEvent] = []
        if self._in_reasoning:
            self._reason(self._pending.rstrip(), events)
        elif self._call is not None:
            call, self._call = self._call, None
            rest = self._pending
            if call.body_done and self.fmt is not None:
                # text held back as a possible start of the end marker is that marker, cut short
                # (at max_tokens): it is not the call's
                end = self.fmt.end if call.freeform_from is None else "\n" + self.fmt.end
                rest = rest[: len(rest) - _partial_suffix(rest, end)]
            if not self._close(call, call.text + rest, events):
                self._content(self.fmt.start + call.text + rest if self.fmt else "", events)
        elif self._pending and not (self.calls and not self._pending.strip()):
            self._content(self._pending, events)
        self._pending = ""
        return events

    # ----------------------------------------------------------------------------------------
    def _content(self, text: str, events: list[OutputEvent]) -> None:
        if self._trim_content:
            text = text.lstrip()
            self._trim_content = not text
        if text:
            self.content += text
            events.append(ContentDelta(text))

    def _reason(self, text: str, events: list[OutputEvent]) -> None:
        if self._trim_reasoning:
            text = text.lstrip()
            self._trim_reasoning = not text
        if text:
            self.reasoning += text
            events.append(ReasoningDelta(text))

    def _scan_reasoning(self, events: list[OutputEvent]) -> bool:
        """Emit reasoning up to its end marker; False when more text is needed."""
        assert self.think is not None
        end = self.think.end
        at = self._pending.find(end)
        if at < 0:
            hold = _held(self._pending, [end])  # whitespace may precede the end marker
            self._reason(self._pending[: len(self._pending) - hold], events)
            self._pending = self._pending[len(self._pending) - hold :]
            return False
        self._reason(self._pending[:at].rstrip(), events)
        self._pending = self._pending[at + len(end) :]
        self._in_reasoning, self._trim_content = False, True
        return True

    def _scan_content(self, events: list[OutputEvent]) -> bool:
        """Emit content up to a call's or the reasoning's opening marker; False when more text
        is needed."""
        call_mark = self.fmt.start if self.fmt else None
        if self.fmt is not None and self.fmt.at_start:
            call_mark = self._call_at_start()
            if call_mark is None and self._call is not None:
                return True  # the answer opened with a call
            if call_mark == "":
                return False  # the answer's first characters may still open a call
        marks = [m for m in (call_mark, self.think and self.think.start) if m]
        if not marks:
            self._content(self._pending, events)
            self._pending = ""
            return False
        found = [(at, m) for m in marks if (at := self._pending.find(m)) >= 0]
        if not found:
            # hold whitespace that may precede a call (the Hermes format puts "\n" before it)
            hold = _held(self._pending, marks, whitespace=self.fmt is not None)
            self._content(self._pending[: len(self._pending) - hold], events)
            self._pending = self._pending[len(self._pending) - hold :]
            return False
        at, start = min(found)
        before = self._pending[:at]
        # whitespace right before a marker is dropped, however the text arrived (it is held
        # back when it ends a chunk, so a whole feed must not keep it either)
        self._content(before.rstrip(), events)
        self._pending = self._pending[at + len(start) :]
        if self.think is not None and start == self.think.start:
            self._in_reasoning, self._trim_reasoning = True, True
        else:
            self._call = OpenCall(len(self.calls), self.id_prefix)
        return True

    def _call_at_start(self) -> str | None:
        """For a format whose call can only open the answer (Llama 3's): open the call when
        the answer begins with its marker and return None; "" while the first characters could
        still become it; None once the answer has begun otherwise (text, or a call made)."""
        assert self.fmt is not None
        if self.content.strip() or self.calls:
            return None
        head = self._pending.lstrip()
        if self.think is not None and head.startswith(self.think.start):
            return None  # reasoning first; the answer starts after it
        if head.startswith(self.fmt.start):
            self._pending = head[len(self.fmt.start) :]
            self._call = OpenCall(len(self.calls), self.id_prefix)
            return None
        if self.fmt.start.startswith(head) or (
            self.think is not None and self.think.start.startswith(head)
        ):
            return ""
        return None

    def _scan_call(self, events: list[OutputEvent]) -> bool:
        """Grow the open call; close it at the end marker. False when more text is needed."""
        call = self._call
        assert call is not None and self.fmt is not None
        if not call.body_done and not self._scan_json_body(call, events):
            return False
        end = self._end_marker(call, events)
        at = self._pending.find(end) if end else -1  # no closing marker: the call ends at EOS
        take = self._pending if at < 0 else self._pending[:at]
        if at < 0:
            keep = _partial_suffix(take, end)
            take = take[: len(take) - keep]
        call.text += take
        self._pending = self._pending[len(take) :]
        if call.freeform_from is not None:
            self._stream_freeform(call, call.text, events)
        elif self.fmt.json_body:
            self._stream_arguments(call, events)
        elif self.fmt.syntax is not None:
            self._stream_syntax(call, events)
        if at < 0:
            return False
        self._pending = self._pending[len(end) :]
        self._call = None
        if not self._close(call, call.text, events):
            self._content(self.fmt.start + call.text + end, events)
        return True

    def _scan_json_body(self, call: OpenCall, events: list[OutputEvent]) -> bool:
        """Take a JSON body whole before looking for the end marker, which a string argument
        may contain (`"</tool_call>"`). False while the body is still open."""
        assert self.fmt is not None
        head = (call.text + self._pending).lstrip()
        if not self.fmt.json_body or (head and not head.startswith("{")):
            call.body_done = True  # not a JSON body: the end marker alone closes the call
            return True
        if not head:
            return False
        ends = call.body.feed(self._pending)
        upto = len(self._pending) if ends is None else ends
        call.text += self._pending[:upto]
        self._pending = self._pending[upto:]
        self._stream_arguments(call, events)
        call.body_done = ends is not None
        return call.body_done

    def _stream_arguments(self, call: OpenCall, events: list[OutputEvent]) -> None:
        if call.name is None:
            match = _NAME.match(call.text)
            if match is None:
                return
            try:
                call.name = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                return
            if call.name in self.custom:  # a custom tool's JSON form: sent whole at the end
                return
            call.args_from = call.args_sent = match.end()
            events.append(ToolCallStarted(call.index, call.id, call.name))
        if call.args_done or call.args_from is None:
            return
        if call.args_sent == call.args_from:  # no whitespace before the arguments' first byte
            rest = call.text[call.args_sent :]
            lead = len(rest) - len(rest.lstrip())
            call.args_from = call.args_sent = call.args_sent + lead
        fresh = call.text[call.args_sent :]
        end = call.scanner.feed(fresh)
        if end is not None:
            fresh, call.args_done = fresh[:end], True
        if fresh:
            call.args_sent += len(fresh)
            events.append(ToolCallDelta(call.index, fresh))

    def _stream_syntax(self, call: OpenCall, events: list[OutputEvent]) -> None:
        """Announce each call of a block (Qwen3-Coder XML, GLM, ...) by its name and pass on
        its arguments as they form. A custom tool's input is sent whole at the end."""
        assert self.fmt is not None and self.fmt.syntax is not None
        if call.stream is None:
            call.stream = self.fmt.syntax.stream(self.fmt.parse, self.tools or None)
        for piece in call.stream.feed(call.text):
            if piece.name is not None:
                if piece.name in self.custom or piece.slot in call.slots:
                    continue
                index = call.index + piece.slot  # the parser returns the block's calls in order
                call_id = piece.id or (call.id if piece.slot == 0 else new_call_id(self.id_prefix))
                call.slots[piece.slot] = (index, call_id, piece.name)
                if call.name is None:
                    call.name = piece.name
                events.append(ToolCallStarted(index, call_id, piece.name))
            elif piece.fragment and piece.slot in call.slots:
                events.append(ToolCallDelta(call.slots[piece.slot][0], piece.fragment))

    def _close(self, call: OpenCall, text: str, events: list[OutputEvent]) -> bool:
        """Parse a complete call with mlx-lm's parser; emit what was not streamed yet."""
        assert self.fmt is not None
        if call.freeform_from is not None:
            return self._close_freeform(call, text, events)
        try:
            parsed: JSON = self.fmt.parse(text, self.tools or None)
        except Exception as exc:  # parsers raise many kinds on malformed text
            log.warning("the model wrote a tool call that does not parse (%s): %.200r", exc, text)
            if call.name is None:
                return False
            parsed = {"name": call.name}  # announced already: finish it with what was streamed
        items = [i for i in (parsed if isinstance(parsed, list) else [parsed]) if _is_call(i)]
        for n, item in enumerate(items):
            slot = call.slots.get(n)
            if call.stream is not None and slot is not None and slot[2] != item["name"]:
                item = {"name": slot[2]}  # a block cut short, misread: keep what was announced
            arguments = item.get("arguments", {})
            index = len(self.calls)
            custom = item["name"] in self.custom
            streamed = call.name is not None and not custom
            if call.stream is not None and slot is not None and slot[2] == item["name"]:
                index, call_id = slot[0], slot[1]
                last, text_args = call.stream.finish(n, item.get("arguments"))
                if last:
                    events.append(ToolCallDelta(index, last))
            elif n == 0 and streamed and call.args_from is not None:
                call_id, text_args = call.id, self._rest_of_arguments(call, text, events)
            else:
                call_id = call.id if n == 0 else new_call_id(self.id_prefix)
                if custom:
                    text_args = input_from_arguments(arguments)
                else:
                    text_args = (
                        arguments
                        if isinstance(arguments, str)
                        else json.dumps(arguments, ensure_ascii=False)
                    )
                events.append(ToolCallStarted(index, call_id, str(item["name"])))
                events.append(ToolCallDelta(index, text_args))
            kind = "custom" if custom else "function"
            done = ToolCall(call_id, str(item["name"]), text_args, kind)
            self.calls.append(done)
            events.append(ToolCallFinished(index, done))
        return bool(items)

    def _rest_of_arguments(self, call: OpenCall, text: str, events: list[OutputEvent]) -> str:
        """The arguments of an announced call: what was streamed, plus any unsent rest."""
        assert call.args_from is not None
        if not call.args_done:  # unconstrained text that ended oddly: send what is left
            rest = text[call.args_sent :].rstrip()
            rest = rest[:-1].rstrip() if rest.endswith("}") else rest
            if rest:
                events.append(ToolCallDelta(call.index, rest))
                call.args_sent += len(rest)
        return text[call.args_from : call.args_sent]

    # -- custom (freeform) tools in the Hermes fallback: a name line, then raw input ------------
    def _end_marker(self, call: OpenCall, events: list[OutputEvent]) -> str:
        """The marker that closes the open call. A freeform call (recognised by its name line)
        ends at the first `\\n</tool_call>`: its raw input may hold the tag inside a line."""
        assert self.fmt is not None
        if call.freeform_from is None and call.name is None and self.custom:
            name = freeform_name(call.text, self.custom) if self.fmt.json_body else None
            if name is not None:
                call.name, call.freeform_from = name, len(call.text)
                events.append(ToolCallStarted(call.index, call.id, name))
        return self.fmt.end if call.freeform_from is None else "\n" + self.fmt.end

    def _stream_freeform(self, call: OpenCall, text: str, events: list[OutputEvent]) -> str:
        """Send the raw input written since the last delta; return the whole input so far."""
        assert call.freeform_from is not None
        after = text[call.freeform_from :]
        whole = raw_input(after) if after else ""
        fresh = whole[call.freeform_sent :] if after else ""
        if fresh:
            call.freeform_sent += len(fresh)
            events.append(ToolCallDelta(call.index, fresh))
        return whole

    def _close_freeform(self, call: OpenCall, text: str, events: list[OutputEvent]) -> bool:
        assert call.name is not None
        done = ToolCall(call.id, call.name, self._stream_freeform(call, text, events), "custom")
        self.calls.append(done)
        events.append(ToolCallFinished(call.index, done))
        return True


def _is_call(item: JSON) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str)


def _held(text: str, markers: list[str], *, whitespace: bool = True) -> int:
    """How much of the end of `text` to hold back: a marker's possible start, and the
    whitespace before it."""
    keep = max(_partial_suffix(text, m) for m in markers)
    if not whitespace:
        return keep
    rest = text[: len(text) - keep]
    return keep + len(rest) - len(rest.rstrip())


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
