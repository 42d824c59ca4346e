"""Llama 3.x's tool calls (3.1, 3.2, 3.3): the answer is one call, as the template renders it,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

and nothing else; no marker opens or closes it (the end of the turn does). mlx-lm has no parser
for it (its templates name no `<tool_call>`), so the server has this one, as llama.cpp does
(`llama_3_x`): a call only at the start of the answer, one per turn (the template refuses
more), the arguments under `parameters`. The grammar makes the model write a declared
function's name and arguments following its schema in the canonical form the template's
`tojson` writes, so a tool loop re-renders what the model sampled. In `auto` an answer is
either a call or text that does not begin with `{` (llama.cpp's trigger: `{"name": "` at the
start); text may mention a call's JSON later without it being one.

Meta's built-in tools (`<|python_tag|>name.call(...)`, `builtin_tools`) are not offered: a
client's tools are always custom tools to the template.
"""

from __future__ import annotations

import json
import re

from mlx_kvserve.chat.call_syntax import Marker, Parameters, ParseToolCall, callable_tools
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

tool_call_start = '{"name": "'  # what opens a call, as the template writes it
tool_call_end = ""  # nothing closes it: the call is the whole answer
_NAME = re.compile(r'[^"\\]+')  # the template writes the name between quotes, unescaped
_HEADER = re.compile(r'([^"\\]+)", "parameters": ')
_PROBE = '{"name": "fn_probe", "parameters": {"k": 1}}'
_UNCALLABLE = (  # why a request none of whose tools this format can call is refused
    "this model's template writes a tool's name inside JSON quotes without escaping, so a "
    'name may not hold `"` or `\\`.'
)


def parse_tool_call(text: str, tools: list[dict[str, JSON]] | None = None) -> dict[str, JSON]:
    """The call whose text after `tool_call_start` is `text` (raises when it is not one)."""
    value = json.loads(tool_call_start + text)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("not a Llama 3 tool call")
    return {"name": value["name"], "arguments": value.get("parameters", {})}


class Llama3Syntax:
    """The CallSyntax of Llama 3.x's JSON calls (see the module docstring)."""

    format = "llama3_json"
    lead = ""
    calls_per_block = False
    between = ""
    at_start = True  # a call only opens the answer
    most_calls = 1  # the template renders one call per assistant turn

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int = 1,
    ) -> str:
        names, rules = [], []
        for k, tool in callable_tools(tools, _NAME.fullmatch, _UNCALLABLE):
            schema = {**parameters(tool), "x-guidance": style}
            head = json.dumps(f'{tool.name}", "parameters": ')
            names.append(f"fn_{k}")
            rules.append(f'fn_{k}: {head} %json {json.dumps(schema)} "}}"')
        return "\n".join([f"call_body: {' | '.join(names)}", *rules])

    def stream(self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None) -> NamedJsonStream:
        return NamedJsonStream(_HEADER)


syntax = Llama3Syntax()
FORMAT = ToolFormat("llama3_json", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    """The model's template renders a call as Llama 3.x's do (mlx-lm has no parser for it)."""
    if mlx_parser(tokenizer) is not None or not isinstance(
        getattr(tokenizer, "chat_template", None), str
    ):
        return None
    return FORMAT if _renders_llama3(tokenizer) else None


@per_tokenizer
def _renders_llama3(tokenizer: Tokenizer) -> bool:
    render = template_render(tokenizer)
    call = {"name": "fn_probe", "arguments": {"k": 1}}
    probe = {"id": "call_probe", "type": "function", "function": call}
    text = None if render is None else rendered_call(render, probe)
    return text is not None and _PROBE in text
