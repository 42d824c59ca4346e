"""How tool calls look in the model's text: the model's own format, or the Hermes fallback.

A tokenizer whose chat template mlx-lm recognises carries a parser from `mlx_lm.tool_parsers`
(chosen by `mlx_lm.tokenizer_utils._infer_tool_parser` at load time); such a template renders the
tool list and the call history itself. A template without tool support (the default model's)
gets one documented format instead, the Hermes convention that Qwen and many others use:

* the tool list as JSON lines inside `<tools></tools>` at the end of the system turn;
* each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
* each tool result as a user turn `<tool_response>\\n...\\n</tool_response>` (consecutive results
  share one turn);
* a custom (freeform) tool, whose input is raw text rather than JSON, listed in its OpenAI shape
  (`{"type": "custom", "name", "description", "format"}`) and called with its name alone on the
  first line and the raw input unquoted after it:
  `<tool_call>\\n{"name": "apply_patch"}\\n*** Begin Patch\\n...\\n</tool_call>`. The input ends
  at the first line that is exactly `</tool_call>`; its own grammar constrains it.

JSON in history is re-serialised with `json.dumps` defaults (`", "` and `": "` separators), the
same form constrained decoding makes the model write, so a conversation re-renders to the tokens
the model generated and the prompt cache keeps the turn.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.tool_parsers import json_tools

from mlx_kvserve.chat import (
    deepseek_v31,  # noqa: I001 (the module, for its markers)
    harmony,
    llama3_json,
)
from mlx_kvserve.chat.call_syntax import CallSyntax
from mlx_kvserve.chat.errors import InvalidRequest
from mlx_kvserve.chat.mistral_legacy_calls import mistral_layout
from mlx_kvserve.chat.request import Message, Tool, ToolCall
from mlx_kvserve.chat.syntaxes import SYNTAXES
from mlx_kvserve.chat.xml_calls import glm_layout

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


@dataclass(frozen=True)
class ToolFormat:
    """The markers and parser of one tool-call format."""

    start: str
    end: str
    parse: Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools)
    native: bool  # the chat template renders tools and calls itself
    json_body: bool  # calls are {"name", "arguments"} JSON: constrainable and streamable
    own_syntax: CallSyntax | None = None  # a syntax read from the model's own template
    harmony: bool = False  # gpt-oss's channels (chat.harmony): its own parser and grammar
    string_arguments: bool = False  # the template renders history arguments as JSON text
    # the tool list as system-prompt text, for a template that does not render `tools` itself
    system_tools: Callable[[list[dict[str, Any]]], str] | None = None

    @property
    def name(self) -> str:
        if not self.native:
            return "hermes"
        if self.own_syntax is not None:
            return self.own_syntax.format
        module = getattr(self.parse, "__module__", "") or ""
        return module.rsplit(".", 1)[-1]

    @property
    def syntax(self) -> CallSyntax | None:
        """How calls in a non-JSON format are constrained and streamed (chat.call_syntax);
        None for the JSON-body formats and for a format parsed only."""
        if not self.native or self.json_body:
            return None
        return self.own_syntax or SYNTAXES.get(self.name)

    @property
    def at_start(self) -> bool:
        """A call may only open the answer (Llama 3's JSON calls), not follow text."""
        return bool(getattr(self.syntax, "at_start", False))

    @property
    def constrained(self) -> bool:
        """Calls in this format get a grammar and stream their arguments."""
        return self.json_body or self.syntax is not None or self.harmony


HERMES = ToolFormat(
    start=json_tools.tool_call_start,
    end=json_tools.tool_call_end,
    parse=json_tools.parse_tool_call,
    native=False,
    json_body=True,
)

LLAMA3 = ToolFormat(
    start=llama3_json.tool_call_start,
    end=llama3_json.tool_call_end,
    parse=llama3_json.parse_tool_call,
    native=True,
    json_body=False,
    own_syntax=llama3_json.LLAMA3,
)

HARMONY = ToolFormat(
    start=harmony.FUNCTIONS,
    end=harmony.CALL,
    parse=harmony.parse_call,
    native=True,
    json_body=False,
    harmony=True,
)


def tool_format_for(tokenizer: Any) -> ToolFormat:
    """The model's own format when mlx-lm found a parser for its template, else Hermes."""
    if harmony.is_harmony(tokenizer):
        return HARMONY
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None or not getattr(tokenizer, "has_tool_calling", False):
        return _own_format(tokenizer) or HERMES
    module = getattr(parser, "__module__", "") or ""
    own = None
    probe = _PROBES.get(module.rsplit(".", 1)[-1])
    if probe is not None and hasattr(tokenizer, "apply_chat_template"):
        if tokenizer not in _layouts:
            _layouts[tokenizer] = probe(lambda m: tokenizer.apply_chat_template(m, tokenize=False))
        own = _layouts[tokenizer]
    return ToolFormat(
        start=tokenizer.tool_call_start,
        end=tokenizer.tool_call_end,
        parse=getattr(own, "parse", None) or parser,  # a layout mlx-lm's parser misreads
        string_arguments=bool(getattr(own, "string_arguments", False)),
        native=True,
        json_body=module.endswith(".json_tools"),
        own_syntax=own,
    )


# formats whose layout is read from the model's own template (None: parsed only)
_PROBES: dict[str, Callable[[Callable[[list[dict[str, Any]]], str]], CallSyntax | None]] = {
    "glm47": glm_layout,
    "mistral": mistral_layout,
}
_layouts: weakref.WeakKeyDictionary[Any, CallSyntax | None] = weakref.WeakKeyDictionary()
_llama3: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _own_format(tokenizer: Any) -> ToolFormat | None:
    """A format mlx-lm has no parser for but this server has (Llama 3.x's, DeepSeek-V3.1's),
    from the model's template."""
    if hasattr(tokenizer, "apply_chat_template") and isinstance(
        getattr(tokenizer, "chat_template", None), str
    ):
        if tokenizer not in _llama3:
            render = lambda m: tokenizer.apply_chat_template(m, tokenize=False)  # noqa: E731
            _llama3[tokenizer] = llama3_json.llama3_syntax(render) is not None
        if _llama3[tokenizer]:
            return LLAMA3
    if not deepseek_v31.is_deepseek_v31(getattr(tokenizer, "chat_template", None)):
        return None
    return ToolFormat(
        start=deepseek_v31.tool_call_start,
        end=deepseek_v31.tool_call_end,
        parse=deepseek_v31.parse_tool_call,
        native=True,
        json_body=False,
        own_syntax=deepseek_v31.DEEPSEEK_V31,
        string_arguments=True,
        system_tools=deepseek_v31.tools_prompt,
    )


def tool_format_notice(tokenizer: Any) -> str:
    """One start-up line: the model's tool-call format and whether calls in it are constrained
    and streamed or only parsed."""
    fmt = tool_format_for(tokenizer)
    if fmt.constrained:
        return f"tool calls: {fmt.name} format, constrained and streamed"
    return (
        f"tool calls: {fmt.name} format, parsed only (no grammar for it yet): tool_choice "
        "'required' and named choices are not enforced and calls arrive whole"
    )


def call_json(name: str, arguments: dict[str, Any]) -> str:
    """The canonical text of one call body (what the grammar makes the model write)."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def freeform_head(name: str) -> str:
    """The first line of a Hermes-fallback custom-tool call: the tool's name alone."""
    return json.dumps({"name": name}, ensure_ascii=False)


def freeform_call(call: ToolCall) -> str:
    """A custom-tool call as the Hermes fallback writes it (the grammar makes the same text)."""
    return f"{HERMES.start}\n{freeform_head(call.name)}\n{call.arguments}\n{HERMES.end}"


def parse_arguments(call: ToolCall, where: str) -> dict[str, Any]:
    """A history call's arguments as an object; a 400 naming the message when they are not.
    A custom tool's raw input becomes `{"input": ...}`, the one parameter templates are shown."""
    if call.kind == "custom":
        return {"input": call.arguments}
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"{where}: the arguments of tool call '{call.id}' are not valid JSON ({exc.msg}).",
            param=where,
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"{where}: the arguments of tool call '{call.id}' must be a JSON object.", param=where
        )
    return value


def hermes_messages(
    messages: list[Message], tools: list[Tool], arguments: list[list[dict[str, Any]]]
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
                else f"{HERMES.start}\n{call_json(c.name, a)}\n{HERMES.end}"
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


def native_messages(
    messages: list[Message], arguments: list[list[dict[str, Any]]], *, as_text: bool = False
) -> list[dict[str, Any]]:
    """OpenAI-style message dicts with arguments as objects, as tool templates iterate them
    (`as_text`: as canonical JSON text, for a template that writes them out whole)."""
    out: list[dict[str, Any]] = []
    for message, args in zip(messages, arguments, strict=True):
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": json.dumps(a, ensure_ascii=False) if as_text else a,
                    },
                }
                for c, a in zip(message.tool_calls, args, strict=True)
            ]
        if message.role == "tool":
            item["tool_call_id"] = message.tool_call_id
            if message.name:
                item["name"] = message.name
        out.append(item)
    return out


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` at the end of the system message (one is added when there is none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{**messages[0], "content": f"{first}\n\n{text}" if first else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
