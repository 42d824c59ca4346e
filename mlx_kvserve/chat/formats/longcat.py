"""LongCat's tool calls (mlx-lm's `longcat` parser): their grammar and streaming.

LongCat writes a call as GLM does, with its own tags:

    <longcat_tool_call>NAME\\n<longcat_arg_key>KEY</longcat_arg_key>\\n<longcat_arg_value>VALUE
    </longcat_arg_value>\\n...</longcat_tool_call>

mlx-lm's parser reads the name as the text before the first `<longcat_arg_key>`, so a call with no
argument does not parse: the grammar never writes one (a call has at least one parameter, and a
tool whose schema allows none cannot be called). A VALUE is raw text (stripped) when its
property's `type` is exactly "string", otherwise the parser reads it as JSON (then as a Python
literal, then as text); the layout and value typing are otherwise `chat.formats.xml_calls`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.tool_parsers.longcat import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.call_syntax import Marker, Parameters
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.formats.xml_calls import _KEY, Layout, _Items, _params_rules
from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON


@dataclass(frozen=True)
class LongcatLayout(Layout):
    """GLM's layout with LongCat's tags; every call has at least one parameter."""

    def kind(self, prop: dict[str, JSON]) -> str:
        """The parser keeps a value raw only for `"type": "string"` exactly; any other spelling
        of a string type it reads as JSON first, so such a value is free text."""
        if prop.get("type") == "string":
            return "string"
        kind = super().kind(prop)
        return "free" if kind == "string" else kind

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        """`call_body`: one call of a declared tool, with at least one parameter."""
        names, rules = [], []
        g = _Items(self, marker)
        for k, tool in enumerate(tools):
            if not _KEY.fullmatch(tool.name):
                continue  # the parser could not read this name back: the model cannot call it
            params = _at_least_one(
                f"f{k}", _params_rules(g, f"f{k}", parameters(tool), style, rules), rules
            )
            if params is None:
                continue  # no parameter can be written: the parser could not read the call
            head = g.items(self.head + tool.name + self.head_end)
            names.append(f"fn_{k}")
            rules.append(f"fn_{k}: {head} {params} {g.items(self.tail)} {marker(end)}")
        if not names:
            raise InvalidRequest(
                "Invalid value for 'tools': this model writes a tool's name in its calls, "
                "followed by at least one argument, so a name needs at least one character and "
                "no spaces, `<` or `>`, and its parameters must allow at least one property.",
                param="tools",
            )
        return "\n".join([f"call_body: {' | '.join(names)}", *rules])


def _at_least_one(prefix: str, params: str, rules: list[str]) -> str | None:
    """`params` (the parameters' Lark expression from `_params_rules`: a sequence of optional or
    required parameter rules, a repeated free parameter, or `""`) with at least one parameter
    written; None when none can be."""
    if params == '""':
        return None
    if params.endswith("_free*"):
        return params[:-1] + "+"
    items = params.split()
    if any(not item.endswith("?") for item in items):
        return params  # a required parameter is always written
    # all optional: the first one written is item i, any of the later ones may follow
    bare = [item[:-1] for item in items]
    for i, item in enumerate(bare):
        rest = f" {prefix}_rest{i + 1}" if i + 1 < len(bare) else ""
        some = f" | {prefix}_some{i + 1}" if i + 1 < len(bare) else ""
        rules.append(f"{prefix}_rest{i}: {item}?{rest}")
        rules.append(f"{prefix}_some{i}: {item}{rest}{some}")
    return f"{prefix}_some0"


syntax = LongcatLayout(
    "longcat",
    "",
    "",
    "\n",
    "<longcat_arg_key>",
    "</longcat_arg_key>\n<longcat_arg_value>",
    "</longcat_arg_value>",
    "\n",
    "",
    strict_strings=False,
    string_types=frozenset({"string"}),
    stops=("</longcat_tool_call>",),
)
FORMAT = ToolFormat("longcat", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "longcat" else None
