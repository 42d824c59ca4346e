"""Muse Spark's tool calls (mlx-lm's `muse_spark` parser, XML_ATEM): their grammar and streaming.

Muse writes every call of a turn in one block, laid out as MiniMax-M2's with `atem:` tags:

    <atem:function_calls>\\n<atem:invoke name="NAME">\\n<atem:parameter name="KEY">VALUE
    </atem:parameter>\\n...</atem:invoke>\\n...</atem:function_calls>

Its parser does not look at the schema: it reads a VALUE as JSON when it can, else as stripped
text. So a string is written as raw text that is not itself JSON (no number, `true`, `null`, ...
and nothing that opens a JSON string, array or object), or as a JSON string when it has no length
bounds; every other value is JSON following the property's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlx_lm.tool_parsers.muse_spark import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.call_syntax import Marker
from mlx_kvserve.chat.formats.minimax_m2 import MinimaxLayout
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.formats.xml_calls import _Items
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

# raw text that `json.loads` reads as something else (a whole JSON value: the text has no
# whitespace at its ends)
_JSON_LIKE = (
    '~/[\\"\\[\\{](?s:.*)/ & ~/-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?/ '
    "& ~/true|false|null|NaN|Infinity|-Infinity/"
)
_JSON_STRING = '/"([^"\\\\\\x00-\\x1f]|\\\\(["\\\\\\/bfnrt]|u[0-9a-fA-F]{4}))*"/'


@dataclass(frozen=True)
class MuseLayout(MinimaxLayout):
    """MiniMax's `<invoke>` layout with Muse's tags and JSON-first values."""

    def kind(self, prop: dict[str, JSON]) -> str:
        """A string property is text (raw or a JSON string; its enum values raw, as the
        template writes them, when the parser reads each back as written); anything else is
        JSON, which the parser reads back exactly."""
        if prop.get("type") != "string":
            return "json"
        enum = prop.get("enum")
        options = [
            *(enum if isinstance(enum, list) else []),
            *([prop["const"]] if "const" in prop else []),
        ]
        return "string" if all(_raw(o) for o in options) else "json"

    def items(self, marker: Marker) -> _Items:
        return _MuseItems(self, marker)


class _MuseItems(_Items):
    """A string value: raw text the parser cannot read as JSON, or a JSON string."""

    def text(self, rules: list[str], terminal: str, low: JSON, high: JSON) -> str:
        low = low if isinstance(low, int) and low >= 0 else 0
        high = high if isinstance(high, int) and high >= low else None
        span = f"{{{low},{'' if high is None else high}}}"
        close = json.dumps(self.layout.value_close + self.layout.value_after)
        tags = "~/(?s:.*<\\/atem:.*)/"  # no closing tag of the block in a value
        plain = f"/(?s:.{span})/ & {tags} & ~/(?s:\\s.*)/ & ~/(?s:.*\\s)/ & {_JSON_LIKE}"
        rules.append(f"{terminal}: ({plain}) {close}")
        if low > 0 or high is not None:
            return terminal  # a JSON string's length is not its value's: raw text only
        rules.append(f"{terminal}_JSON: ({_JSON_STRING} & {tags}) {close}")
        return f"({terminal} | {terminal}_JSON)"


def _raw(value: JSON) -> bool:
    """The parser reads this string back unchanged from raw text."""
    if not isinstance(value, str) or not value or value != value.strip() or "</" in value:
        return False
    try:
        json.loads(value)
    except ValueError:
        return True
    return False


syntax = MuseLayout(
    "muse_spark",
    "",
    '<atem:invoke name="',
    '">\n',
    '<atem:parameter name="',
    '">',
    "</atem:parameter>",
    "\n",
    "</atem:invoke>\n",
    strict_strings=False,
    string_types=frozenset({"string"}),
    stops=("</atem:invoke>", "</atem:function_calls>"),
)
FORMAT = ToolFormat("muse_spark", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "muse_spark" else None
