"""The tool-call format a model speaks (`ToolFormat`), and what the format modules share to
detect theirs.

Each format module (chat.formats.*) has the surface of mlx-lm's parser modules
(`mlx_lm/tool_parsers/*.py`: `tool_call_start`, `tool_call_end`, `parse_tool_call`), plus:

* `syntax`: how its calls are constrained and streamed (chat.call_syntax); None for the
  `{"name", "arguments"}` JSON bodies, which chat.grammar and chat.output handle themselves, and
  for a format that is parsed only;
* `detect(tokenizer)`: the model's `ToolFormat` when the model speaks this format, else None.

The registry (`chat.formats.FORMATS`) asks the modules in order; nothing else picks a format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from mlx_kvserve.chat.call_syntax import AnswerRules, CallSyntax, ParseToolCall
from mlx_kvserve.chat.events import OutputReader
from mlx_kvserve.chat.grammar import Constraint
from mlx_kvserve.chat.output import OutputParser
from mlx_kvserve.chat.reasoning.reasoning_gate import ReasoningGate
from mlx_kvserve.chat.reasoning.thinking import ThinkMarkers
from mlx_kvserve.chat.request import Message, Tool
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.engine.requests import TokenConstraint
from mlx_kvserve.json_value import JSON

Render = Callable[[list[dict[str, JSON]]], str]  # messages -> the chat template's text
T = TypeVar("T")


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes tool calls (its markers, parser and syntax), and what its turns
    need of the template, the grammar, the output reader and the thinking budget. The defaults
    are those of a model that writes calls in its text; gpt-oss's channels override them
    (chat.formats.harmony)."""

    name: str  # mlx-lm's parser module name, or the server's own ("hermes", "llama3_json", ...)
    start: str
    end: str
    parse: ParseToolCall
    syntax: CallSyntax | None = None
    native: bool = True  # the chat template renders tools and calls itself
    json_body: bool = False  # calls are {"name", "arguments"} JSON: constrainable and streamable
    string_arguments: bool = False  # the template renders history arguments as JSON text
    # the tool list as system-prompt text, for a template that does not render `tools` itself
    system_tools: Callable[[list[dict[str, JSON]]], str] | None = None
    end_tokens: tuple[str, ...] = ()  # tokens that end the model's turn besides its EOS
    # the rules of the whole answer, for a format that lays it out itself (gpt-oss's channels)
    answer_rules: AnswerRules | None = None

    @property
    def at_start(self) -> bool:
        """A call may only open the answer (Llama 3's JSON calls), not follow text."""
        return bool(getattr(self.syntax, "at_start", False))

    @property
    def constrained(self) -> bool:
        """Calls in this format get a grammar and stream their arguments."""
        return self.json_body or self.syntax is not None or self.answer_rules is not None

    def template_inputs(
        self, messages: list[Message], tools: list[Tool], arguments: list[list[dict[str, JSON]]]
    ) -> tuple[list[dict[str, JSON]], dict[str, JSON]]:
        """The message dicts and template arguments (the tool list) that render the
        conversation: the template renders tools and calls itself, each call's arguments as
        objects (`arguments`, chat.render.check_history) or as JSON text."""
        out = native_messages(messages, arguments, as_text=self.string_arguments)
        if not tools:
            return out, {}
        listed = self.template_tools([t.as_openai() for t in tools])
        if self.system_tools is not None:  # a template that does not list the tools
            out = with_system_text(out, self.system_tools(listed))
        return out, {"tools": listed}

    def template_tools(self, tools: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
        """The tool list (OpenAI's shape) as the model's template reads it."""
        return tools

    def template_messages(self, messages: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
        """Message dicts (OpenAI's shape, past reasoning as `reasoning_content`) as the model's
        template reads them."""
        return messages

    def reader(
        self,
        tools: list[Tool],
        *,
        parse_calls: bool,
        id_prefix: str,
        markers: ThinkMarkers | None,
        reasoning: bool,
    ) -> OutputReader:
        """What reads the model's text back as reasoning, content and tool calls."""
        return OutputParser(
            self,
            tools,
            parse_calls=parse_calls,
            id_prefix=id_prefix,
            markers=markers,
            reasoning=reasoning,
        )

    def thinking_gate(
        self,
        tokenizer: Tokenizer,
        inner: Constraint | None,
        budget: int | None,
        markers: ThinkMarkers | None,
        reasoning: bool,
    ) -> TokenConstraint | None:
        """The decoding constraint: for a model that reasons, a thinking budget and the
        answer's grammar (`inner`) kept out of the reasoning (chat.reasoning.reasoning_gate);
        otherwise the grammar alone."""
        if markers is None:
            return inner
        if budget is None and inner is None:
            return None  # nothing to enforce: free sampling stays pipelined
        return ReasoningGate(markers, reasoning=reasoning, budget=budget, inner=inner)


def native_messages(
    messages: list[Message], arguments: list[list[dict[str, JSON]]], *, as_text: bool = False
) -> list[dict[str, JSON]]:
    """OpenAI-style message dicts with arguments as objects, as tool templates iterate them
    (`as_text`: as canonical JSON text, for a template that writes them out whole)."""
    out: list[dict[str, JSON]] = []
    for message, args in zip(messages, arguments, strict=True):
        item: dict[str, JSON] = {"role": message.role, "content": message.content}
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


def with_system_text(messages: list[dict[str, JSON]], text: str) -> list[dict[str, JSON]]:
    """`text` at the end of the system message (one is added when there is none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{**messages[0], "content": f"{first}\n\n{text}" if first else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def mlx_parser(tokenizer: Tokenizer) -> str | None:
    """The name of the parser mlx-lm gave the tokenizer at load (`mlx_lm.tokenizer_utils.load`
    takes it from the tokenizer's config or infers it from the chat template), or None."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None or not getattr(tokenizer, "has_tool_calling", False):
        return None
    module = getattr(parser, "__module__", "") or ""
    return module.rsplit(".", 1)[-1]


def template_render(tokenizer: Tokenizer) -> Render | None:
    """The model's chat template as a function of the messages (to see how it writes a call),
    or None for a tokenizer that cannot render."""
    if not hasattr(tokenizer, "apply_chat_template"):
        return None
    return lambda messages: tokenizer.apply_chat_template(messages, tokenize=False)


def rendered_call(render: Render, call: dict[str, JSON]) -> str | None:
    """The template's text for a conversation whose assistant turn makes `call` (a `tool_calls`
    entry), or None when the template refuses it."""
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    try:
        return render(messages)
    except Exception:  # a template that cannot render the probe
        return None
