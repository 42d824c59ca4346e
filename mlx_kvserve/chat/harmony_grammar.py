"""The llguidance grammar of a gpt-oss answer with tools (chat.harmony; chat.grammar compiles it).

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

* `tool_choice` "auto": any messages, then the answer or a call;
* "required" and a named function: at most one analysis message, then the call (a thinking
  budget, chat.harmony_gate, ends an analysis that runs on);
* `response_format`: the final answer is that JSON.
The template renders one call per assistant message, so parallel calls are not offered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mlx_kvserve.chat import harmony
from mlx_kvserve.chat.errors import InvalidRequest
from mlx_kvserve.chat.request import ChatRequest, Tool

Marker = Callable[[str], str]  # a control token as a Lark item (its token id)
_NAME = re.compile(r"[^\s<]+")  # what a call's header can carry as the recipient


def harmony_rules(
    req: ChatRequest,
    marker: Marker,
    parameters: Callable[[Tool], dict[str, Any]],
    style: dict[str, Any],
    output: dict[str, Any] | None,
    output_style: dict[str, Any],
) -> list[str]:
    """The Lark rules (for chat.grammar's `_lark`) of a tools request's answer."""
    ch, msg = marker(harmony.CHANNEL), marker(harmony.MESSAGE)
    end, start, constrain = marker(harmony.END), marker(harmony.START), marker(harmony.CONSTRAIN)
    tools = req.tools
    if req.tool_choice.mode == "function":
        tools = [t for t in tools if t.name == req.tool_choice.name]
    rules = [
        "BODY: /(.|\\n)*/",
        f'analysis: {ch} "analysis" {msg} BODY {end} {start} "assistant"',
        f'preamble: {ch} "commentary" {msg} BODY {end} {start} "assistant"',
    ]
    names = []
    for k, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name):
            continue  # the header could not carry this name: the model cannot call it
        schema = json.dumps({**parameters(tool), "x-guidance": style})
        name = tool.name
        names.append(f"fn_{k}")
        rules.append(
            f"fn_{k}: {json.dumps(' to=' + harmony.FUNCTIONS + name)} {ch} "
            f'"commentary json" {msg} %json {schema}\n'
            f"    | {ch} {json.dumps('commentary to=' + harmony.FUNCTIONS + name)} "
            f'(" " {constrain} "json" | " json")? {msg} %json {schema}'
        )
    if not names:
        raise InvalidRequest(
            "Invalid value for 'tools': this model writes a tool's name in a message header, "
            "so a name needs at least one character and no spaces or `<`.",
            param="tools",
        )
    rules.append(f"call: {' | '.join(names)}")
    if output is not None:
        answer = f"%json {json.dumps({**output, 'x-guidance': output_style})}"
    else:
        answer = "BODY"
    rules.append(f'final: {ch} "final" {msg} {answer}')
    if req.tool_choice.mode in {"required", "function"}:
        return ["start: analysis? call", *rules]
    return ["start: (analysis | preamble)* (final | call)", *rules]
