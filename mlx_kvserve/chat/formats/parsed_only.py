"""Any other parser mlx-lm gives a tokenizer (Laguna's, and those of newer mlx-lm versions): the
model's calls are read by that parser when the closing marker arrives and sent whole, without a
grammar (the start-up notice says so).

It has no markers or parser of its own: they are the ones mlx-lm chose, read off the tokenizer.
"""

from __future__ import annotations

from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.tokenizer import Tokenizer

syntax = None  # parsed only


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    name, parse = mlx_parser(tokenizer), getattr(tokenizer, "tool_parser", None)
    if name is None or parse is None:
        return None
    start, end = getattr(tokenizer, "tool_call_start", ""), getattr(tokenizer, "tool_call_end", "")
    return ToolFormat(name, start, end, parse)
