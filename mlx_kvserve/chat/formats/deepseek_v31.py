"""DeepSeek-V3.1's tool calls, which mlx-lm has no parser for: the format, its parser, its
grammar and streaming.

DeepSeek-V3.1 writes every call of a turn in one block, each call's arguments as JSON:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>   (one line, nothing between the markers)

Its chat template renders calls in history (their `arguments` as the JSON text itself) and tool
results, but not the tool list: the model card has the caller describe the tools in the system
prompt, in a fixed form (`tools_prompt`, as Ollama's renderer writes it). The grammar makes the
model write declared functions' names and arguments following their schemas, in the canonical
JSON form (`", "`, `": "`) history is rendered in, so a tool loop re-renders what it sampled.
"""

from __future__ import annotations

import json
import re

from mlx_kvserve.chat.call_syntax import (
    CallPiece,
    Marker,
    Parameters,
    ParseToolCall,
    callable_tools,
)
from mlx_kvserve.chat.formats.tool_format import ToolFormat, mlx_parser
from mlx_kvserve.chat.request import Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

tool_call_start = "<｜tool▁calls▁begin｜>"
tool_call_end = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.DOTALL
)
_HEADER = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP))
# a name the parser reads back whole, and a tokenizer can write (no control characters)
_NAME = re.compile(r"[^\s<>｜\x00-\x1f\x7f]+")

# why a request none of whose tools this format can call is refused
_UNCALLABLE = (
    "this model writes a tool's name bare in its calls, so a name needs at least one "
    "character and no spaces, `<` or `>`."
)


def is_deepseek_v31(template: object) -> bool:
    """The chat template renders DeepSeek-V3.1's calls (V3.1 and V3.1-Terminus). R1, its
    distills and V3-0324 use the same markers in another layout (`function<｜tool▁sep｜>NAME`
    and a fenced JSON block), which this format does not write: they keep the fallback."""
    if not isinstance(template, str) or "```json" in template:
        return False
    return all(m in template for m in (tool_call_start, SEP))


def parse_tool_call(
    text: str, tools: list[dict[str, JSON]] | None = None
) -> dict[str, JSON] | list[dict[str, JSON]]:
    """The calls of one block (the text after `<｜tool▁calls▁begin｜>`), in mlx-lm's parser
    shape: one call, or a list of them."""
    calls = []
    for name, arguments in _CALL.findall(text):
        value = json.loads(arguments) if arguments.strip() else {}
        if not isinstance(value, dict):
            raise ValueError(f"Could not parse tool call arguments: {arguments!r}")
        calls.append({"name": name.strip(), "arguments": value})
    if not calls:
        raise ValueError("No function provided.")
    return calls[0] if len(calls) == 1 else calls


def tools_prompt(tools: list[dict[str, JSON]]) -> str:
    """The tool section of the system prompt, in the form DeepSeek-V3.1's model card gives."""
    lines = ["## Tools", "You have access to the following tools:"]
    for tool in tools:
        function = tool.get("function", {})
        lines += [
            "",
            f"### {function.get('name', '')}",
            f"Description: {function.get('description') or ''}",
            "",
            f"Parameters: {json.dumps(function.get('parameters') or {}, ensure_ascii=False)}",
        ]
    lines += [
        "",
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:",
        f"{tool_call_start}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}"
        "{{additional_tool_calls}}" + tool_call_end,
        "",
        "Where:",
        "",
        "- `tool_call_name` must be an exact match to one of the available tools",
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
        "Parameters Schema",
        "- For multiple tool calls, chain them directly without separators or spaces",
    ]
    return "\n".join(lines)


class DeepSeekV31Syntax:
    """The CallSyntax of DeepSeek-V3.1's block of calls."""

    format = "deepseek_v31"
    lead = ""
    calls_per_block = True

    def calls_rule(
        self,
        tools: list[Tool],
        parameters: Parameters,
        style: dict[str, JSON],
        marker: Marker,
        end: str,
        most: int,
    ) -> str:
        names, rules = [], []
        for k, tool in callable_tools(tools, lambda name: _NAME.fullmatch(name), _UNCALLABLE):
            schema = {**parameters(tool), "x-guidance": style}
            names.append(f"fn_{k}")
            rules.append(
                f"fn_{k}: {marker(CALL_BEGIN)} {json.dumps(tool.name)} {marker(SEP)} "
                f"%json {json.dumps(schema)} {marker(CALL_END)}"
            )
        more = f" one_call{{0,{most - 1}}}" if most > 1 else ""
        return "\n".join(
            [
                f"call_body: one_call{more} {marker(end)}",
                f"one_call: {' | '.join(names)}",
                *rules,
            ]
        )

    def stream(
        self, parse: ParseToolCall, tools: list[dict[str, JSON]] | None
    ) -> DeepSeekV31Stream:
        return DeepSeekV31Stream()


class DeepSeekV31Stream:
    """Follows one block as it grows: each call's name at its `<｜tool▁sep｜>`, then its JSON
    arguments as they are written, up to the call's end marker."""

    def __init__(self) -> None:
        self._pos = 0
        self._slot = -1
        self._open = False
        self.sent: dict[int, str] = {}

    def feed(self, text: str) -> list[CallPiece]:
        out: list[CallPiece] = []
        while True:
            if not self._open:
                header = _HEADER.search(text, self._pos)
                if header is None:
                    return out
                self._slot += 1
                self.sent[self._slot] = ""
                out.append(CallPiece(self._slot, header.group(1).strip()))
                self._pos, self._open = header.end(), True
            end = text.find(CALL_END, self._pos)
            upto = end if end >= 0 else len(text) - _partial(text[self._pos :], CALL_END)
            fresh = text[self._pos : upto]
            if fresh:
                self.sent[self._slot] += fresh
                out.append(CallPiece(self._slot, fragment=fresh))
            self._pos = upto
            if end < 0:
                return out
            self._pos, self._open = end + len(CALL_END), False

    def finish(self, slot: int, arguments: JSON) -> tuple[str, str]:
        sent = self.sent.get(slot, "")
        if arguments is None:
            return "", sent
        try:
            if json.loads(sent) == arguments:
                return "", sent
        except ValueError:
            pass
        whole = json.dumps(arguments if isinstance(arguments, dict) else {}, ensure_ascii=False)
        if whole.startswith(sent):
            return whole[len(sent) :], whole
        return "", whole  # unconstrained text the parser read otherwise than streamed


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


syntax = DeepSeekV31Syntax()
FORMAT = ToolFormat(
    "deepseek_v31",
    tool_call_start,
    tool_call_end,
    parse_tool_call,
    syntax,
    string_arguments=True,
    system_tools=tools_prompt,
)


def detect(tokenizer: Tokenizer) -> ToolFormat | None:
    """The model's template renders DeepSeek-V3.1's calls (mlx-lm has no parser for them)."""
    if mlx_parser(tokenizer) is not None:
        return None
    return FORMAT if is_deepseek_v31(getattr(tokenizer, "chat_template", None)) else None
