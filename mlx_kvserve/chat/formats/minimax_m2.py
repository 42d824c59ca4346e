"""MiniMax-M2's tool calls (mlx-lm's `minimax_m2` parser): their grammar and streaming.

MiniMax-M2's template writes every call of a turn in one block:

    \\n<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n
    ...</invoke>\\n<invoke name="...">...</invoke>\\n</minimax:tool_call>

The parser reads each VALUE by the types the property's schema names (`type`, `enum`, `anyOf`
...): a string is the raw text (stripped, "null" read as None), other types JSON. The layout and
value typing are `chat.formats.xml_calls`'s (one tag per parameter); here they are laid out as the
template writes them and repeated up to `most` `<invoke>`s per block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlx_lm.tool_parsers.minimax_m2 import (
    _extract_types_from_schema,
    parse_tool_call,
    tool_call_end,
    tool_call_start,
)

from mlx_kvserve.chat.call_syntax import (
    CallPiece,
    Marker,
    Parameters,
    ParseToolCall,
    callable_tools,
)
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.formats.xml_calls import _KEY, Layout, XmlCallStream, _Items, _params_rules
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

_STRINGS = {"string", "str", "text"}
_JSON = {"integer", "int", "number", "float", "object", "array"}
_INVOKE = '<invoke name="'

# why a request none of whose tools this format can call is refused
_UNCALLABLE = (
    "this model writes a tool's name in its calls, so a name needs at least one character "
    "and no spaces, quotes, `<` or `>`."
)


@dataclass(frozen=True)
class MinimaxLayout(Layout):
    """The `<invoke>` layout, several calls per block."""

    calls_per_block = True

    def kind(self, prop: dict[str, JSON]) -> str:
        """How the parser converts a value: by the one type the schema names (a property
        without one is a string to it); a mix of types is read by priority, so it is free."""
        types = {str(t).lower() for t in _extract_types_from_schema(prop)}
        if len(types) != 1:
            return "free"
        (kind,) = types
        if kind in _STRINGS:
            return "string"
        if kind in {"boolean", "bool"}:
            return "bool"
        if kind == "null":
            return "null"
        return "json" if kind in _JSON else "free"

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        """`call_body`: one to `most` `<invoke>`s of the declared tools, then the closing
        marker."""
        names, rules = [], []
        g = self.items(marker)
        for k, tool in callable_tools(
            tools, lambda name: _KEY.fullmatch(name) and '"' not in name, _UNCALLABLE
        ):
            head = g.items(self.head + tool.name + self.head_end)
            params = _params_rules(g, f"f{k}", parameters(tool), style, rules)
            names.append(f"fn_{k}")
            rules.append(f"fn_{k}: {head} {params} {g.items(self.tail)}")
        count = "" if most <= 1 else f"{{1,{most}}}"
        return "\n".join(
            [
                f'call_body: "\\n" invoke{count} {marker(end)}',
                f"invoke: {' | '.join(names)}",
                *rules,
            ]
        )

    def items(self, marker: Marker) -> _Items:
        """How this layout's fixed text and raw values become Lark items."""
        return _Items(self, marker)

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> InvokeStream:
        return InvokeStream(self, parse, tools)


syntax = MinimaxLayout(
    "minimax_m2",
    "\n",
    _INVOKE,
    '">\n',
    '<parameter name="',
    '">',
    "</parameter>",
    "\n",
    "</invoke>\n",
    strict_strings=False,
    string_types=frozenset(_STRINGS),
    stops=("</invoke>", "</minimax:tool_call>"),
    null_is_none=True,
)


class InvokeStream:
    """Follows one block's `<invoke>`s (the layout's `head`, closed by its `tail`): each is a
    call (`XmlCallStream`), numbered in order."""

    def __init__(
        self, layout: Layout, parse: ParseToolCall, tools: list[dict[str, JSON]] | None
    ) -> None:
        self._layout, self._parse, self._tools = layout, parse, tools
        self._calls: list[XmlCallStream] = []

    def feed(self, text: str) -> list[CallPiece]:
        starts = [m.start() for m in re.finditer(re.escape(self._layout.head), text)]
        close = self._layout.tail.strip()
        out: list[CallPiece] = []
        for slot, start in enumerate(starts):
            if slot == len(self._calls):
                self._calls.append(XmlCallStream(self._layout, self._parse, self._tools))
            stop = starts[slot + 1] if slot + 1 < len(starts) else len(text)
            closed = text.find(close, start, stop)
            part = text[start : stop if closed < 0 else closed]
            for piece in self._calls[slot].feed(part):
                out.append(CallPiece(slot, piece.name, piece.fragment))
        return out

    def finish(self, slot: int, arguments: JSON) -> tuple[str, str]:
        return self._calls[slot].finish(0, arguments)


FORMAT = ToolFormat("minimax_m2", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "minimax_m2" else None
