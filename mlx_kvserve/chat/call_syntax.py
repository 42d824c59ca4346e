"""What a tool-call format must offer to be constrained and streamed: its `CallSyntax`.

A format whose calls are not `{"name", "arguments"}` JSON (the Hermes form `chat.grammar` and
`chat.output` handle themselves) plugs in through one object per format:

* `calls_rule(...)` gives the Lark rule `call_body`: everything after the format's opening
  marker up to and including its closing marker, for calls to the given tools only (names
  limited to theirs, arguments typed by their JSON Schemas). `chat.grammar` builds the rest:
  lazy in `auto` (triggered by the opening marker), forced for `required` and a named choice.
* `stream(parse, tools)` gives a `CallStream` that follows the text of one block (after the
  opening marker) as it grows and passes on each call's name and its arguments as OpenAI-shaped
  JSON fragments; the fragments of a call, plus the last one `finish` gives, concatenate to the
  JSON object the format's own parser reads from the whole block.

A block may hold several calls (Kimi's section, MiniMax's `<invoke>`s, a pythonic list): such a
syntax sets `calls_per_block` and its `call_body` allows up to `most` calls; the stream numbers
the calls of its block from 0 in the order the parser returns them.

Each format module (chat.formats) names its syntax; the format the registry picks for a model
(`chat.formats.tool_format_for`) carries it, and is what chat.grammar and chat.output are given
(`CallFormat`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import ChatRequest, Tool
from mlx_kvserve.json_value import JSON

Marker = Callable[[str], str]  # a tag as a Lark item: its own token, or the literal text
Parameters = Callable[[Tool], dict[str, JSON]]  # a tool's JSON Schema for its arguments
# mlx-lm's `parse_tool_call(text, tools)`: the text of one block (after its opening marker) and
# the request's tools in OpenAI's shape, to the JSON of one call {"name", "arguments"} or a list
ParseToolCall = Callable[[str, list[dict[str, JSON]] | None], JSON]
# the rules of a whole answer (gpt-oss's): request, marker, literal (fixed text as its tokens),
# parameters, the tools' JSON style, the output schema (response_format) and its JSON style
AnswerRules = Callable[
    [
        ChatRequest,
        Marker,
        Marker,
        Parameters,
        dict[str, JSON],
        dict[str, JSON] | None,
        dict[str, JSON],
    ],
    list[str],
]


@dataclass(frozen=True)
class CallPiece:
    """One step of a streamed call: `name` is set once, when call `slot` is announced (with
    `id`, the call's id when the format has the model write one, as Kimi's do); `fragment` is
    more of its arguments' JSON text."""

    slot: int
    name: str | None = None
    fragment: str = ""
    id: str | None = None


class CallStream(Protocol):
    def feed(self, text: str) -> list[CallPiece]:
        """New pieces, given the whole block text so far (after the opening marker)."""
        ...

    def finish(self, slot: int, arguments: JSON) -> tuple[str, str]:
        """(the last fragment, the call's whole arguments text) for call `slot`, given the
        arguments the format's parser read (None: it did not parse; what was streamed)."""
        ...


class CallSyntax(Protocol):
    @property
    def format(self) -> str:
        """mlx-lm's parser module name for this format (e.g. "qwen3_coder")."""
        ...

    @property
    def lead(self) -> str:
        """Text before a forced call's opening marker (the template's, so history re-renders)."""
        ...

    @property
    def calls_per_block(self) -> bool:
        """Several calls share one opening and closing marker."""
        ...

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int,
    ) -> str:
        """Lark rules defining `call_body` (see the module docstring); 400 when no tool can be
        called in this format."""
        ...

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> CallStream:
        """A stream for one block; `parse` is the format's parser."""
        ...


class CallFormat(Protocol):
    """What chat.grammar and chat.output read of the model's tool format (the registry's
    `chat.formats.tool_format.ToolFormat`)."""

    @property
    def start(self) -> str:
        """The marker that opens a call (or a block of calls)."""
        ...

    @property
    def end(self) -> str:
        """The marker that closes it ("": the end of the answer does)."""
        ...

    @property
    def parse(self) -> ParseToolCall: ...

    @property
    def syntax(self) -> CallSyntax | None:
        """How calls are constrained and streamed; None for the JSON-body formats (which
        chat.grammar and chat.output handle themselves) and for a format parsed only."""
        ...

    @property
    def native(self) -> bool:
        """The chat template renders the tools and calls itself (False: the Hermes fallback,
        which also offers custom tools as a name line and raw input)."""
        ...

    @property
    def json_body(self) -> bool:
        """Calls are `{"name", "arguments"}` JSON after the opening marker."""
        ...

    @property
    def at_start(self) -> bool:
        """A call may only open the answer (Llama 3's), not follow text."""
        ...

    @property
    def constrained(self) -> bool:
        """Calls in this format get a grammar."""
        ...

    @property
    def answer_rules(self) -> AnswerRules | None:
        """The Lark rules of the whole answer, for a format that lays out the answer itself
        (gpt-oss's channels); None: the answer is free text around the calls, and chat.grammar
        builds it from `syntax` or the JSON body."""
        ...


def callable_tools(
    tools: list[Tool], writable: Callable[[str], object], why: str
) -> list[tuple[int, Tool]]:
    """(index, tool) of the tools whose names a format can write and its parser read back
    (`writable(name)`); the model cannot call the others in it. None left: a 400 saying `why`."""
    found = [(k, tool) for k, tool in enumerate(tools) if writable(tool.name)]
    if not found:
        raise InvalidRequest(f"Invalid value for 'tools': {why}", param="tools")
    return found
