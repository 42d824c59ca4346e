"""A conversation as prompt token ids, with the positions worth a prompt-cache checkpoint.

Two boundaries matter: the end of the leading system messages, tool list included (an "anchor"
every conversation with that system prompt and those tools shares), and the end of everything
before the newest message (where an edited last message, a branch, or an agent's next turn
restarts). Each is found by rendering the template on that prefix of the messages; it counts only
when its tokens are an exact prefix of the full prompt's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_kvserve.chat.errors import InvalidRequest
from mlx_kvserve.chat.request import ChatRequest, Message
from mlx_kvserve.chat.tool_format import (
    ToolFormat,
    hermes_messages,
    native_messages,
    parse_arguments,
    tool_format_for,
)


@dataclass
class Prompt:
    """Token ids to prefill and {position: "anchor" | "message"} checkpoint boundaries."""

    tokens: list[int]
    boundaries: dict[int, str]
    tool_format: ToolFormat | None = None


def check_history(messages: list[Message]) -> list[list[dict[str, Any]]]:
    """Validate tool-call history; return each message's call arguments as objects."""
    seen: set[str] = set()
    arguments: list[list[dict[str, Any]]] = []
    for i, message in enumerate(messages):
        where = message.origin or f"messages[{i}]"
        args = [
            parse_arguments(
                call, where if message.origin else f"{where}.tool_calls[{j}].function.arguments"
            )
            for j, call in enumerate(message.tool_calls)
        ]
        seen.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in seen:
            raise InvalidRequest(
                f"{where}: this tool result answers tool call "
                f"'{message.tool_call_id}', but no earlier assistant message made that call.",
                param=where if message.origin else f"{where}.tool_call_id",
            )
        arguments.append(args)
    return arguments


def render_chat(tokenizer: Any, req: ChatRequest) -> Prompt:
    """Prompt tokens for a chat request, through the model's template (or the Hermes fallback)."""
    arguments = check_history(req.messages)
    fmt = tool_format_for(tokenizer)
    tools = req.tools
    if fmt.native:
        messages: list[dict[str, Any]] = native_messages(req.messages, arguments)
        kwargs: dict[str, Any] = {"tools": [t.as_openai() for t in tools]} if tools else {}
    else:
        messages = hermes_messages(req.messages, tools, arguments)
        kwargs = {}
    try:
        prompt, messages = _render_folding_system(tokenizer, messages, kwargs)
    except Exception as exc:  # template errors are the request's fault (e.g. role order)
        raise InvalidRequest(
            f"The chat template rejected the messages: {exc}", param="messages"
        ) from None
    return Prompt(prompt, _boundaries(tokenizer, messages, kwargs, prompt), fmt)


def render_text(tokenizer: Any, text: str) -> Prompt:
    """A text completion's prompt; it has no message structure to checkpoint at."""
    if not text:
        raise InvalidRequest("Invalid value for 'prompt': it is empty.", param="prompt")
    return Prompt(list(tokenizer.encode(text)), {})


def _render_folding_system(
    tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict
) -> tuple[list[int], list[dict[str, Any]]]:
    """The prompt, and the messages it was rendered from.

    Agents put system messages mid-conversation (Claude Code's reminders). Many templates
    (Mistral's, Llama 2's, Gemma's) accept a system message only first; when the template refuses,
    each later system message is folded into the user turn next to it as
    `<system-reminder>` text, Claude Code's own convention, and the render is tried once more.
    """
    try:
        return _render(tokenizer, messages, kwargs, generation=True), messages
    except Exception:
        folded = fold_late_system(messages)
        if folded == messages:
            raise
        return _render(tokenizer, folded, kwargs, generation=True), folded


def fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each system message after the first message, moved into the user turn it stands next to:
    the next one (unless an assistant turn comes first), else the one just before it, else a user
    turn of its own in its place."""
    out = [dict(m) for m in messages]
    for i in range(len(out) - 1, 0, -1):
        if out[i]["role"] != "system":
            continue
        reminder = f"<system-reminder>\n{out.pop(i)['content']}\n</system-reminder>"
        turn = next(
            (j for j in range(i, len(out)) if out[j]["role"] in ("user", "assistant")), None
        )
        if turn is not None and out[turn]["role"] == "user":
            out[turn]["content"] = f"{reminder}\n{out[turn]['content']}"
        elif out[i - 1]["role"] == "user":
            out[i - 1]["content"] = f"{out[i - 1]['content']}\n{reminder}"
        else:
            out.insert(i, {"role": "user", "content": reminder})
    return out


def _render(tokenizer: Any, messages: list, kwargs: dict, *, generation: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=False, **kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _boundaries(tokenizer: Any, messages: list, kwargs: dict, prompt: list[int]) -> dict[int, str]:
    boundaries: dict[int, str] = {}
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if 0 < n_system < len(messages):
        anchor = _boundary(tokenizer, messages[:n_system], kwargs, prompt)
        if anchor:
            boundaries[anchor] = "anchor"
    if len(messages) > 1 and len(messages) - 1 != n_system:
        newest = _boundary(tokenizer, messages[:-1], kwargs, prompt)
        if newest:
            boundaries.setdefault(newest, "message")
    return boundaries


def _boundary(tokenizer: Any, messages: list, kwargs: dict, prompt: list[int]) -> int | None:
    try:
        ids = _render(tokenizer, messages, kwargs, generation=False)
    except Exception:  # a template may refuse a partial conversation; then there is no boundary
        return None
    if 0 < len(ids) < len(prompt) - 1 and prompt[: len(ids)] == ids:
        return len(ids)
    return None
