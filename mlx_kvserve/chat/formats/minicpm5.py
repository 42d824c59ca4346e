"""MiniCPM5's tool calls (mlx-lm's `minicpm5` parser): their grammar and streaming.

MiniCPM5 writes each call as its own element, with no wrapper, parallel calls one per line:

    <function name="NAME"><param name="KEY">VALUE</param>...</function>

mlx-lm's opening marker is `<function name=` and its closing one `</function>`. A VALUE holding
`<`, `&` or a newline is wrapped as `<![CDATA[...]]>`, which the parser reads verbatim; any other
is stripped. Either is then converted by the types the property's schema names, as MiniMax's
are (`"null"` is None whatever the type). The grammar writes a string as the template does,
plain text without those characters or CDATA holding one, never one the parser reads otherwise;
the rest of the layout and the value typing are `chat.formats.xml_calls`'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlx_lm.tool_parsers.minicpm5 import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.call_syntax import Marker, Parameters, callable_tools
from mlx_kvserve.chat.formats.minimax_m2 import MinimaxLayout
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.formats.xml_calls import _KEY, Layout, _Items, _params_rules
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

_CDATA_OPEN, _CDATA_CLOSE = "<![CDATA[", "]]>"

# why a request none of whose tools this format can call is refused
_UNCALLABLE = (
    "this model writes a tool's name in its calls, so a name needs at least one character "
    "and no spaces, quotes, `<` or `>`."
)


@dataclass(frozen=True)
class MiniCpmLayout(Layout):
    """The `<function name=...>` layout: one call per element."""

    kind = MinimaxLayout.kind  # values are converted as MiniMax's parser does

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        """`call_body`: a declared tool's quoted name, its parameters and `</function>`."""
        names, rules = [], []
        g = _CdataItems(self, marker)
        for k, tool in callable_tools(
            tools, lambda name: _KEY.fullmatch(name) and '"' not in name, _UNCALLABLE
        ):
            head = g.items(self.head + tool.name + self.head_end)
            params = _params_rules(g, f"f{k}", parameters(tool), style, rules)
            names.append(f"fn_{k}")
            rules.append(f"fn_{k}: {head} {params} {g.items(self.tail)} {marker(end)}")
        return "\n".join([f"call_body: {' | '.join(names)}", *rules])


class _CdataItems(_Items):
    """Raw values as the template writes them: plain text, or CDATA when they hold `<`, `&` or
    a newline."""

    def text(self, rules: list[str], terminal: str, low: JSON, high: JSON) -> str:
        low = low if isinstance(low, int) and low >= 0 else 0
        high = high if isinstance(high, int) and high >= low else None
        span = f"{{{low},{'' if high is None else high}}}"
        close = self.layout.value_close + self.layout.value_after
        # each is one lexeme with its closing tag, which the value cannot hold (xml_calls)
        plain = (
            f"/(?s:.{span})/ & ~/(?s:.*[<&\\n].*)/ & ~/(?i:null)/ & ~/(?s:\\s.*)/ & ~/(?s:.*\\s)/"
        )
        cdata = (  # only what the template wraps: text holding `<`, `&` or a newline
            f"/(?s:.{span})/ & /(?s:.*[<&\\n].*)/ & ~/(?s:.*(\\]\\]>|<\\/param>|<\\/function>).*)/"
        )
        rules.append(f"{terminal}: ({plain}) {json.dumps(close)}")
        rules.append(
            f"{terminal}_CDATA: {json.dumps(_CDATA_OPEN)} ({cdata}) "
            f"{json.dumps(_CDATA_CLOSE + close)}"
        )
        return f"({terminal} | {terminal}_CDATA)"


syntax = MiniCpmLayout(
    "minicpm5",
    "",
    '"',
    '">',
    '<param name="',
    '">',
    "</param>",
    "",
    "",
    strict_strings=False,
    string_types=frozenset({"string", "str", "text"}),
    stops=("</function>",),
    null_is_none=True,
)
FORMAT = ToolFormat("minicpm5", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "minicpm5" else None
