"""GLM-4.5/4.6/4.7's tool calls (mlx-lm's `glm47` parser), one tag pair per parameter:

    <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>

GLM-4.5/4.6 put a newline after the name and after each value, GLM-4.7 none: the layout is read
from the model's own template (`glm_layout`). Constrained and streamed by
chat.formats.xml_calls.
"""

from __future__ import annotations

import re

from mlx_lm.tool_parsers.glm47 import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.formats.tool_format import (
    Render,
    ToolFormat,
    mlx_parser,
    rendered_call,
    template_render,
)
from mlx_kvserve.chat.formats.xml_calls import Layout
from mlx_kvserve.chat.tokenizer import Tokenizer, per_tokenizer

syntax = Layout(  # GLM-4.5/4.6's
    "glm47",
    "\n",
    "",
    "\n",
    "<arg_key>",
    "</arg_key>\n<arg_value>",
    "</arg_value>",
    "\n",
    "",
    strict_strings=False,
    string_types=frozenset({"string"}),
)
_PROBE = re.compile(
    r"([ \t\n]*)<tool_call>([ \t\n]*)fn_probe([ \t\n]*)<arg_key>k1</arg_key>([ \t\n]*)"
    r"<arg_value>v1</arg_value>([ \t\n]*)<arg_key>k2</arg_key>[ \t\n]*<arg_value>v2</arg_value>"
    r"([ \t\n]*)</tool_call>"
)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return _format(tokenizer) if mlx_parser(tokenizer) == "glm47" else None


@per_tokenizer
def _format(tokenizer: Tokenizer) -> ToolFormat:
    render = template_render(tokenizer)
    layout = syntax if render is None else glm_layout(render)
    return ToolFormat("glm47", tool_call_start, tool_call_end, parse_tool_call, layout)


def glm_layout(render: Render) -> Layout:
    """GLM's layout as the model's own template writes a call (`render(messages)` is the
    template's text); GLM-4.6's when the template does not render the probe call."""
    call = {"name": "fn_probe", "arguments": {"k1": "v1", "k2": "v2"}}
    text = rendered_call(render, {"type": "function", "function": call})
    match = None if text is None else _PROBE.search(text)
    if match is None:
        return syntax
    lead, head, head_end, key_gap, after, tail = match.groups()
    return Layout(
        syntax.format,
        lead[-1:] if lead.endswith("\n") else "",
        head,
        head_end,
        syntax.key_open,
        f"</arg_key>{key_gap}<arg_value>",
        syntax.value_close,
        after,
        tail[len(after) :] if tail.startswith(after) else tail,
        strict_strings=False,
        string_types=syntax.string_types,
    )
