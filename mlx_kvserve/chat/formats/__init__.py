"""Tool-call formats: one module per format, named as mlx-lm names its parser
(`mlx_lm/tool_parsers/`), plus the server's own (`llama3_json`, `deepseek_v31`, gpt-oss's
`harmony`, the `hermes` fallback), and one ordered registry that picks the model's.

Each module has the same surface (chat.formats.tool_format): `tool_call_start`,
`tool_call_end`, `parse_tool_call`, `syntax` and `detect(tokenizer)`. `tool_format_for` asks
them in `FORMATS`' order and takes the first format that recognises the model:

* gpt-oss's harmony first (its vocabulary and template say so, whatever else they hold);
* the formats of mlx-lm's parsers, each when mlx-lm gave the tokenizer that parser at load
  (`mlx_lm.tokenizer_utils._infer_tool_parser` reads it from the template), then any other
  parser mlx-lm has, parsed only;
* the formats mlx-lm has no parser for, found from the template: Llama 3.x, DeepSeek-V3.1;
* the Hermes fallback, for a template without tool support.

A new format is a module with that surface, placed in `FORMATS`.
"""

from __future__ import annotations

from mlx_kvserve.chat.formats import (
    deepseek_v31,
    function_gemma,
    gemma4,
    glm47,
    harmony,
    hermes,
    json_tools,
    kimi_k2,
    kimi_k3,
    llama3_json,
    longcat,
    minicpm5,
    minimax_m2,
    mistral,
    muse_spark,
    parsed_only,
    pythonic,
    qwen3_coder,
)
from mlx_kvserve.chat.formats.tool_format import ToolFormat
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.vocabulary import token_ids

FORMATS = (
    harmony,
    # mlx-lm's parsers, in the order mlx_lm.tokenizer_utils._infer_tool_parser tries them
    minimax_m2,
    gemma4,
    function_gemma,
    longcat,
    glm47,
    pythonic,
    qwen3_coder,
    kimi_k2,
    minicpm5,
    mistral,
    muse_spark,
    json_tools,
    kimi_k3,
    parsed_only,
    # the server's own, from the template
    llama3_json,
    deepseek_v31,
    hermes,  # any model
)


def tool_format_for(tokenizer: Tokenizer) -> ToolFormat:
    """The model's tool-call format: the first in `FORMATS` that recognises it."""
    found = (module.detect(tokenizer) for module in FORMATS)
    return next(fmt for fmt in found if fmt is not None)  # the last, Hermes, takes any model


def tool_format_notice(tokenizer: Tokenizer) -> str:
    """One start-up line: the model's tool-call format and whether calls in it are constrained
    and streamed or only parsed."""
    fmt = tool_format_for(tokenizer)
    if fmt.constrained:
        return f"tool calls: {fmt.name} format, constrained and streamed"
    return (
        f"tool calls: {fmt.name} format, parsed only (no grammar for it yet): tool_choice "
        "'required' and named choices are not enforced and calls arrive whole"
    )


def add_end_tokens(tokenizer: Tokenizer) -> None:
    """Make the tokens that end the model's turn in its format end a generation (gpt-oss's
    `<|call|>` and `<|return|>`: its config names only one)."""
    tokens = tool_format_for(tokenizer).end_tokens
    add = getattr(tokenizer, "add_eos_token", None)
    if not tokens or add is None:
        return
    vocab = token_ids(tokenizer)
    for token in tokens:
        if token in vocab:
            add(token)
