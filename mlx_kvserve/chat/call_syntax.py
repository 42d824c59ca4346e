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

The registry (`chat.syntaxes.SYNTAXES`) maps mlx-lm's parser module name to its syntax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mlx_kvserve.chat.errors import InvalidRequest
from mlx_kvserve.chat.request import Tool

Marker = Callable[[str], str]  # a tag as a Lark item: its own token, or the literal text
Parameters = Callable[[Tool], dict[str, Any]]  # a tool's JSON Schema for its arguments


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

    def finish(self, slot: int, arguments: Any) -> tuple[str, str]:
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
        style: dict[str, Any],
        marker: Marker,
        end: str,
        most: int,
    ) -> str:
        """Lark rules defining `call_body` (see the module docstring); 400 when no tool can be
        called in this format."""
        ...

    def stream(self, parse: Any, tools: list[dict[str, Any]] | None) -> CallStream:
        """A stream for one block; `parse` is mlx-lm's `parse_tool_call(text, tools)`."""
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
