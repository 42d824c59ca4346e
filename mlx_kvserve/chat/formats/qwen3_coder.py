"""Qwen3-Coder's and Qwen3.5/3.6's tool calls (mlx-lm's `qwen3_coder` parser), one tag per
parameter:

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

Constrained and streamed by chat.formats.xml_calls, whose docstring says how values are typed.
"""

from __future__ import annotations

from mlx_lm.tool_parsers.qwen3_coder import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.formats.xml_calls import STRING_TYPES, Layout
from mlx_kvserve.chat.tokenizer import Tokenizer

syntax = Layout(
    "qwen3_coder",
    "",
    "\n<function=",
    ">\n",
    "<parameter=",
    ">\n",
    "\n</parameter>",
    "\n",
    "</function>\n",
    strict_strings=True,
    string_types=frozenset(STRING_TYPES),
)
FORMAT = ToolFormat("qwen3_coder", tool_call_start, tool_call_end, parse_tool_call, syntax)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "qwen3_coder" else None
