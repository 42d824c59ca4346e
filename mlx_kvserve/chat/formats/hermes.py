"""The fallback for a template without tool support (the default model's): the Hermes
convention that Qwen and many others use, rendered by the server.

* the tool list as JSON lines inside `<tools></tools>` at the end of the system turn;
* each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
* each tool result as a user turn `<tool_response>\\n...\\n</tool_response>` (consecutive results
  share one turn);
* a custom (freeform) tool, whose input is raw text rather than JSON, listed in its OpenAI shape
  (`{"type": "custom", "name", "description", "format"}`) and called with its name alone on the
  first line and the raw input unquoted after it:
  `<tool_call>\\n{"name": "apply_patch"}\\n*** Begin Patch\\n...\\n</tool_call>`. The input ends
  at the first line that is exactly `</tool_call>`; its own grammar constrains it.

The calls are mlx-lm's `json_tools` bodies, which chat.grammar constrains and chat.output
streams. JSON in history is re-serialised with `json.dumps` defaults (`", "` and `": "`
separators), the same form constrained decoding makes the model write, so a conversation
re-renders to the tokens the model generated and the prompt cache keeps the turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlx_lm.tool_parsers.json_tools import parse_tool_call, tool_call_end, tool_call_start

from mlx_kvserve.chat.formats.tool_format import ToolFormat
from mlx_kvserve.chat.freeform import freeform_head
from mlx_kvserve.chat.request import Message, Tool, ToolCall
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

HERMES_INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
FREEFORM_INSTRUCTIONS = (
    "\n\nA tool of type custom takes raw text, not JSON: write its name as a json object on the "
    "first line and the raw input after it, unquoted, within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <tool-name>}}\n<raw-input>\n</tool_call>'
)

syntax = None  # JSON bodies: chat.grammar and chat.output handle them


@dataclass(frozen=True)
class HermesFormat(ToolFormat):
    """The fallback: the server renders the tools and calls into plain messages."""

    def template_inputs(
        self, messages: list[Message], tools: list[Tool], arguments: list[list[dict[str, JSON]]]
    ) -> tuple[list[dict[str, JSON]], dict[str, JSON]]:
        return hermes_messages(messages, tools, arguments), {}


FORMAT = HermesFormat(
    "hermes", tool_call_start, tool_call_end, parse_tool_call, native=False, json_body=True
)


def detect(tokenizer: Tokenizer) -> ToolFormat:
    """Any model: the registry asks this format last."""
    return FORMAT


def call_json(name: str, arguments: dict[str, JSON]) -> str:
    """The canonical text of one call body (what the grammar makes the model write)."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def freeform_call(call: ToolCall) -> str:
    """A custom-tool call as the Hermes fallback writes it (the grammar makes the same text)."""
    return f"{tool_call_start}\n{freeform_head(call.name)}\n{call.arguments}\n{tool_call_end}"


def hermes_messages(
    messages: list[Message], tools: list[Tool], arguments: list[list[dict[str, JSON]]]
) -> list[dict[str, str]]:
    """Plain {role, content} messages for a template without tool support."""
    out: list[dict[str, str]] = []
    if tools:
        listing = "\n".join(
            json.dumps(t.as_freeform() if t.is_custom else t.as_openai(), ensure_ascii=False)
            for t in tools
        )
        block = HERMES_INSTRUCTIONS.format(tools=listing)
        if any(t.is_custom for t in tools):
            block += FREEFORM_INSTRUCTIONS.format()
        if messages and messages[0].role == "system":
            first = messages[0].content
            out.append({"role": "system", "content": f"{first}\n\n{block}" if first else block})
            messages, arguments = messages[1:], arguments[1:]
        else:
            out.append({"role": "system", "content": block})
    for message, args in zip(messages, arguments, strict=True):
        if message.role == "assistant" and message.tool_calls:
            calls = "\n".join(
                freeform_call(c)
                if c.kind == "custom"
                else f"{tool_call_start}\n{call_json(c.name, a)}\n{tool_call_end}"
                for c, a in zip(message.tool_calls, args, strict=True)
            )
            text = f"{message.content}\n{calls}" if message.content else calls
            out.append({"role": "assistant", "content": text})
        elif message.role == "tool":
            response = f"<tool_response>\n{message.content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool": "1"})
        else:
            out.append({"role": message.role, "content": message.content})
    for item in out:
        item.pop("_tool", None)
    return out
