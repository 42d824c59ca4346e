"""Mistral's tool calls (mlx-lm's `mistral` parser): their grammar and streaming, for the layout
of Mistral's v13 tokenizer templates (Devstral 2, Ministral 3, Mistral Large 3):

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}

Each call opens with `[TOOL_CALLS]`, nothing closes it: the answer ends after the last call's
JSON (the end-of-sequence token follows in history). The grammar makes the model write a
declared function's name, `[ARGS]` and its arguments as JSON following the function's schema,
in the canonical form the template's `tojson` writes, so a tool loop re-renders what it sampled.

The older layouts, v7 (Mistral Small 3, 3.1: one JSON list of `{"name", "arguments", "id"}`
objects) and v11 (Mistral Small 3.2, Magistral, Devstral 1: `name[CALL_ID]id[ARGS]{...}`), are
in chat.formats.mistral_legacy; `detect` tells the three apart by rendering a probe call with
the model's own template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mlx_lm.tool_parsers.mistral import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.call_syntax import Marker, Parameters, ParseToolCall, callable_tools
from mlx_kvserve.chat.formats.mistral_legacy import (
    MISTRAL_V7,
    MISTRAL_V11,
    fit_call_ids,
    parse_v11,
)
from mlx_kvserve.chat.formats.named_json import NamedJsonStream
from mlx_kvserve.chat.formats.tool_format import (
    ToolFormat,
    mlx_parser,
    rendered_call,
    template_render,
)
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer, per_tokenizer
from mlx_kvserve.json_value import JSON

_NAME = re.compile(r"[\w-]+")  # what the parser reads as a name before `[ARGS]`
_HEADER = re.compile(r"(?:\[TOOL_CALLS\])?\s*([\w-]+)\s*\[ARGS\]\s*")
V13_PROBE = '[TOOL_CALLS]fn_probe[ARGS]{"k": 1}'
V11_PROBE = 'fn_probe[CALL_ID]abcdefghi[ARGS]{"k": 1}'
V7_PROBE = '[TOOL_CALLS][{"name": "fn_probe", "arguments": {"k": 1}, "id": "abcdefghi"}]'

# why a request none of whose tools this format can call is refused
_UNCALLABLE = (
    "this model writes a tool's name before `[ARGS]`, so it needs letters, digits, `_` or `-` only."
)


class MistralSyntax:
    """The CallSyntax of the v13 `[TOOL_CALLS]name[ARGS]{json}` layout."""

    format = "mistral"
    lead = ""
    calls_per_block = False
    between = ""  # each call opens with its own [TOOL_CALLS], nothing between them

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        args = marker("[ARGS]")
        names, rules = [], []
        for k, tool in callable_tools(tools, lambda name: _NAME.fullmatch(name), _UNCALLABLE):
            schema = {**parameters(tool), "x-guidance": style}
            names.append(f"fn_{k}")
            rules.append(f"fn_{k}: {json.dumps(tool.name)} {args} %json {json.dumps(schema)}")
        return "\n".join([f"call_body: {' | '.join(names)}", *rules])

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> NamedJsonStream:
        return NamedJsonStream(_HEADER)


syntax = MistralSyntax()  # v13's
V13 = ToolFormat("mistral", tool_call_start, tool_call_end, parse_tool_call, syntax)
# mlx-lm's parser reads v11's call id as the name: this layout parses itself


@dataclass(frozen=True)
class FittedIds(ToolFormat):
    """v11's and v7's templates refuse a call id that is not 9 letters or digits: history
    ids are fitted (chat.formats.mistral_legacy.fit_call_ids), so calls and results pair up."""

    def template_messages(self, messages: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
        return fit_call_ids(messages, 9)


# mlx-lm's parser reads v11's call id as the name: this layout parses itself
V11 = FittedIds("mistral", tool_call_start, tool_call_end, parse_v11, MISTRAL_V11)
# Its template joins plain text to `arguments|tojson|safe`, and Jinja escapes text joined to safe
# markup: arguments given as an object render as `&#34;name&#34;`. Given as JSON text they
# render as written.
V7 = FittedIds(
    "mistral", tool_call_start, tool_call_end, parse_tool_call, MISTRAL_V7, string_arguments=True
)
PARSED_ONLY = ToolFormat("mistral", tool_call_start, tool_call_end, parse_tool_call)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return _format(tokenizer) if mlx_parser(tokenizer) == "mistral" else None


@per_tokenizer
def _format(tokenizer: Tokenizer) -> ToolFormat:
    """The layout the model's template writes calls in (v13, v11 or v7), found by rendering a
    probe call; parsed only when it is none of them."""
    render = template_render(tokenizer)
    call = {"name": "fn_probe", "arguments": '{"k": 1}'}  # as text: see V7
    probe = {"id": "abcdefghi", "type": "function", "function": call}
    text = None if render is None else rendered_call(render, probe)
    for written, fmt in ((V13_PROBE, V13), (V11_PROBE, V11), (V7_PROBE, V7)):
        if text is not None and written in text:
            return fmt
    return PARSED_ONLY
