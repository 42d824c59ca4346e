"""Calls as `{"name", "arguments"}` JSON between `<tool_call>` tags, in a template that renders
them itself (mlx-lm's `json_tools` parser: Qwen2.5, Qwen3 and the many templates like theirs).

The bodies are constrained by chat.grammar and streamed by chat.output, as the Hermes
fallback's are (chat.formats.hermes), whose server-rendered convention this is.
"""

from __future__ import annotations

from mlx_lm.tool_parsers.json_tools import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.tokenizer import Tokenizer

syntax = None  # JSON bodies: chat.grammar and chat.output handle them
FORMAT = ToolFormat("json_tools", tool_call_start, tool_call_end, parse_tool_call, json_body=True)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if mlx_parser(tokenizer) == "json_tools" else None
