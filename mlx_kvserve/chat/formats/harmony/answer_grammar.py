"""The llguidance grammar of a gpt-oss answer with tools (chat.formats.harmony; chat.grammar
compiles it).

After the generation prompt's `<|start|>assistant`, gpt-oss writes messages: analysis (its
reasoning) and commentary preambles, each ended by `<|end|><|start|>assistant`, then either a
final answer (`<|channel|>final<|message|>...`, ended by `<|return|>`, an end-of-sequence token)
or one call. The grammar keeps the messages' text free (text cannot hold a control token, so the
token ends it) and constrains the call: its name is one of the declared tools, its arguments are
JSON valid against that tool's schema, in the canonical form (`", "`, `": "`) that the template's
`tojson` renders history in. A call may be written as the template renders calls,
` to=functions.NAME<|channel|>commentary json<|message|>{...}`, or as gpt-oss often writes
them, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`; the grammar
ends with the arguments, where the model would write `<|call|>`, so generation stops there.
The headers' fixed words are given as the tokens the tokenizer makes of them (`literal`), so the
model cannot spell them otherwise than the template's rendering of the turn will: a tool loop's
next prompt then continues the tokens the model sampled, which gpt-oss's sliding-window layers
(caches that cannot be trimmed back) need to reuse the turn.

* `tool_choice` "auto": any messages, then the answer or a call;
* "required" and a named function: at most one analysis message, then the call in the
  template's form (a thinking budget, harmony.analysis_gate, ends an analysis that runs on);
* `response_format`: the final answer is that JSON (without tools: after at most one analysis
  message).
The template renders one call per assistant message, so parallel calls are not offered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from mlx_kvserve.chat.formats.harmony import channels
from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import ChatRequest, Tool
from mlx_kvserve.json_value import JSON

Marker = Callable[[str], str]  # text as Lark items: a control token's id, fixed text's tokens
_NAME = re.compile(r"[^\s<]+")  # what a call's header can carry as the recipient


def harmony_rules(
    req: ChatRequest,
    marker: Marker,
    literal: Marker,
    parameters: Callable[[Tool], dict[str, JSON]],
    style: dict[str, JSON],
    output: dict[str, JSON] | None,
    output_style: dict[str, JSON],
) -> list[str]:
    """The Lark rules (for chat.grammar's `_lark`) of an answer with tools or an output
    schema."""
    ch, msg = marker(channels.CHANNEL), marker(channels.MESSAGE)
    end, start, constrain = marker(channels.END), marker(channels.START), marker(channels.CONSTRAIN)
    forced = req.tools_active and req.tool_choice.mode in {"required", "function"}
    tools = req.tools if req.tools_active else []
    if req.tool_choice.mode == "function":
        tools = [t for t in tools if t.name == req.tool_choice.name]
    again = f"{end} {start} {literal('assistant')}"
    rules = [
        "BODY: /(.|\\n)*/",
        f"analysis: {ch} {literal('analysis')} {msg} BODY {again}",
        f"preamble: {ch} {literal('commentary')} {msg} BODY {again}",
    ]
    names = []
    for k, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name):
            continue  # the header could not carry this name: the model cannot call it
        schema = json.dumps({**parameters(tool), "x-guidance": style})
        to = channels.FUNCTIONS + tool.name
        names.append(f"fn_{k}")
        rule = (
            f"fn_{k}: {literal(' to=' + to)} {ch} {literal('commentary json')} {msg} %json {schema}"
        )
        if not forced:  # the model's own habit; history re-renders in the template's form
            rule += (
                f"\n    | {ch} {literal('commentary to=' + to)} "
                f"({literal(' ')} {constrain} {literal('json')} | {literal(' json')})? "
                f"{msg} %json {schema}"
            )
        rules.append(rule)
    if tools and not names:
        raise InvalidRequest(
            "Invalid value for 'tools': this model writes a tool's name in a message header, "
            "so a name needs at least one character and no spaces or `<`.",
            param="tools",
        )
    if names:
        rules.append(f"call: {' | '.join(names)}")
    if output is not None:
        answer = f"%json {json.dumps({**output, 'x-guidance': output_style})}"
    else:
        answer = "BODY"
    rules.append(f"final: {ch} {literal('final')} {msg} {answer}")
    if forced:
        return ["start: analysis? call", *rules]
    if not names:  # a response_format without tools: the final answer is that JSON
        return ["start: analysis? final", *rules]
    return ["start: (analysis | preamble)* (final | call)", *rules]
