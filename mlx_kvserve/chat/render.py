"""A conversation as prompt token ids, with the positions worth a prompt-cache checkpoint.

Two boundaries matter: the end of the leading system messages, tool list included (an "anchor"
every conversation with that system prompt and those tools shares), and the end of everything
before the newest message (where an edited last message, a branch, or an agent's next turn
restarts). Each is found by rendering the template on that prefix of the messages; it counts only
when its tokens are an exact prefix of the full prompt's tokens. A third, "prompt", is where the
next turn's prompt will depart from this one when the generation prompt opens the reasoning
(`<think>` at its end): templates that strip past reasoning render the next turn's answer
without it (mlx-lm's server keeps the same segment). Elsewhere the engine marks the prompt's
end itself where the cache cannot be trimmed (engine.generate).

The template is also told what the client asked of the model's reasoning
(chat.reasoning.thinking), and each past assistant turn's reasoning is handed to it as
`reasoning_content`, the key the Qwen, GLM and DeepSeek templates read (gpt-oss's reads
`thinking`: chat.formats.harmony). A past turn that made tool calls and is replayed unchanged is
encoded as the tokens the model sampled for it (chat.reasoning.sampled_turns), so a tool loop's
next prompt extends the cached one through the answer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

from mlx_kvserve.chat.formats import tool_format_for
from mlx_kvserve.chat.formats.tool_format import ToolFormat
from mlx_kvserve.chat.image_markup import Placement
from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.reasoning.sampled_turns import (
    SampledTurn,
    SampledTurns,
    Splicer,
    text_hash,
    turn_end,
)
from mlx_kvserve.chat.reasoning.thinking import (
    ThinkMarkers,
    check_template_kwargs,
    markers_for,
    opens_reasoning,
    reasoning_tail,
    template_kwargs,
    template_variables,
)
from mlx_kvserve.chat.request import ChatRequest, Message, ToolCall
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.engine.image_prefill import Markup
from mlx_kvserve.images.image import Image
from mlx_kvserve.images.spans import ImageSpan
from mlx_kvserve.json_value import JSON
from mlx_kvserve.vocabulary import unknown_token_id


@dataclass
class Prompt:
    """Token ids to prefill and {position: "anchor" | "message" | "prompt"} checkpoint
    boundaries; `reasoning`: the answer starts inside the model's reasoning section."""

    tokens: list[int]
    boundaries: dict[int, str]
    tool_format: ToolFormat | None = None
    markers: ThinkMarkers | None = None
    reasoning: bool = False
    text: tuple[int, bytes] = (0, b"")  # the length and SHA-256 of the rendered text
    images: tuple[Image, ...] = ()  # a vision model's images, in prompt order
    image_spans: tuple[ImageSpan, ...] = ()  # ... and where each one's placeholders are


def check_history(messages: list[Message]) -> list[list[dict[str, JSON]]]:
    """Validate tool-call history; return each message's call arguments as objects."""
    seen: set[str] = set()
    arguments: list[list[dict[str, JSON]]] = []
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


def parse_arguments(call: ToolCall, where: str) -> dict[str, JSON]:
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


def render_chat(
    tokenizer: Tokenizer,
    req: ChatRequest,
    defaults: dict[str, JSON] | None = None,
    sampled: SampledTurns | None = None,
    model: str = "",
    vision: Markup | None = None,
) -> Prompt:
    """Prompt tokens for a chat request, through the model's template (or the Hermes fallback).

    `defaults` are the server's `--chat-template-kwargs`, under the request's own. Turns of the
    history that `sampled` kept for `model` are encoded as the tokens the model sampled.
    `vision`: a vision model's markup, which its images get in the prompt (chat/image_markup.py)."""
    placement = Placement(vision) if vision is not None else None
    if placement is not None:
        req = dataclasses.replace(req, messages=placement.place(req.messages))
    arguments = check_history(req.messages)
    check_template_kwargs(req.template_kwargs, "chat_template_kwargs")
    kept = _kept_turns(req.messages, sampled, model)
    for i, turn in kept.items():  # a kept turn's arguments, in the order they were sampled
        arguments[i] = turn.template_arguments()
    fmt = tool_format_for(tokenizer)
    messages, kwargs = fmt.template_inputs(req.messages, req.tools, arguments)
    _add_reasoning(req.messages, messages)
    messages = fmt.template_messages(messages)
    variables = template_variables(tokenizer)
    kwargs.update(template_kwargs(variables, req.thinking, req.template_kwargs, defaults or {}))
    try:
        text, messages = _render_folding_system(tokenizer, messages, kwargs)
    except Exception as exc:  # template errors are the request's fault (e.g. role order)
        raise InvalidRequest(
            f"The chat template rejected the messages: {exc}", param="messages"
        ) from None
    encode = _splicer(tokenizer, req.messages, messages, kwargs, kept, placement)
    prompt = encode(text)
    boundaries = _boundaries(tokenizer, messages, kwargs, prompt, encode)
    markers = markers_for(tokenizer)
    opened = opens_reasoning(markers, prompt)
    departs = reasoning_tail(markers, prompt, THINKING_TAIL)
    if departs is not None:
        boundaries.setdefault(departs, "prompt")
    images, spans = placement.spans(text, prompt) if placement is not None else ((), ())
    return Prompt(
        prompt,
        boundaries,
        fmt,
        markers,
        opened is not None,
        (len(text), text_hash(text)),
        images,
        spans,
    )


THINKING_TAIL = 11  # how near the end an opening marker counts as the generation prompt's


def _add_reasoning(source: list[Message], messages: list[dict[str, JSON]]) -> None:
    """Past reasoning as `reasoning_content` on each assistant message dict (the templates that
    render it read that key; the others ignore it). Assistant turns keep their order in both."""
    given = [m for m in source if m.role == "assistant"]
    rendered = [m for m in messages if m["role"] == "assistant"]
    for message, item in zip(given, rendered, strict=False):
        if message.reasoning is not None:
            item["reasoning_content"] = message.reasoning


def render_text(tokenizer: Tokenizer, text: str) -> Prompt:
    """A text completion's prompt; it has no message structure to checkpoint at."""
    if not text:
        raise InvalidRequest("Invalid value for 'prompt': it is empty.", param="prompt")
    return Prompt(list(tokenizer.encode(text)), {})


def render_token_ids(tokenizer: Tokenizer, ids: list[int]) -> Prompt:
    """A text completion given as token ids (as evaluation harnesses send it): every id must be
    one the tokenizer knows, or the model would read past its embedding table or a padded row
    no token has (mlx_kvserve/vocabulary.py)."""
    unknown = unknown_token_id(tokenizer, ids)
    if unknown is not None:
        bad, size = unknown
        raise InvalidRequest(
            f"Invalid value for 'prompt': token id {bad} is outside the vocabulary "
            f"(0 to {size - 1}).",
            param="prompt",
        )
    return Prompt(list(ids), {})


def continuing(prompt: Prompt, context: list[int]) -> Prompt:
    """`prompt` after the token ids of an earlier exchange (Ollama's `context`: the prompt and
    answer it returned), which the prompt cache finds already computed."""
    if not context:
        return prompt
    shift = len(context)
    return dataclasses.replace(
        prompt,
        tokens=[*context, *prompt.tokens],
        boundaries={shift: "message", **{shift + k: v for k, v in prompt.boundaries.items()}},
        image_spans=tuple(
            dataclasses.replace(span, start=span.start + shift) for span in prompt.image_spans
        ),
        text=(0, b""),  # not the rendered text alone: no sampled turn is kept by it
    )


def _kept_turns(
    source: list[Message], sampled: SampledTurns | None, model: str
) -> dict[int, SampledTurn]:
    """{index in `source`: the kept turn it replays unchanged} (chat.reasoning.sampled_turns)."""
    if sampled is None or not len(sampled):
        return {}
    return {
        i: turn
        for i, message in enumerate(source)
        if message.role == "assistant" and (turn := sampled.match(message, model)) is not None
    }


def _splicer(
    tokenizer: Tokenizer,
    source: list[Message],
    messages: list[dict[str, JSON]],
    kwargs: dict[str, JSON],
    kept: dict[int, SampledTurn],
    placement: Placement | None = None,
) -> Callable[[str], list[int]]:
    """The text-to-tokens step of this conversation: the tokenizer's, with the kept turns'
    sampled tokens spliced in (chat.reasoning.sampled_turns) and the images' markup in place
    of their sentinels (chat/image_markup.py)."""

    def encode(text: str) -> list[int]:
        if placement is not None:
            text = placement.expand(text)
        return list(tokenizer.encode(text, add_special_tokens=False))

    if not kept:
        return encode
    given = [kept.get(i) for i, m in enumerate(source) if m.role == "assistant"]
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    turns = [(i, turn) for i, turn in zip(at, given, strict=False) if turn is not None]
    splicer = Splicer(
        encode,
        lambda n, generation: _render(tokenizer, messages[:n], kwargs, generation=generation),
        lambda: turn_end(lambda m: _render(tokenizer, m, kwargs, generation=False)),
        turns,
    )
    return splicer.tokens


def _render_folding_system(
    tokenizer: Tokenizer, messages: list[dict[str, JSON]], kwargs: dict[str, JSON]
) -> tuple[str, list[dict[str, JSON]]]:
    """The prompt, and the messages it was rendered from.

    Agents put system messages mid-conversation (Claude Code's reminders). Many templates
    (Mistral's, Llama 2's, Gemma's) accept a system message only first; when the template refuses,
    each later system message is folded into the user turn next to it as
    `<system-reminder>` text, Claude Code's own convention, and the render is tried once more.
    """
    try:
        return _render(tokenizer, messages, kwargs, generation=True), messages
    except Exception as refused:
        folded = fold_late_system(messages)
        if folded == messages:
            raise
        try:
            return _render(tokenizer, folded, kwargs, generation=True), folded
        except Exception:
            raise refused from None  # the client's messages were refused: say why they were


def fold_late_system(messages: list[dict[str, JSON]]) -> list[dict[str, JSON]]:
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


def _render(
    tokenizer: Tokenizer,
    messages: list[dict[str, JSON]],
    kwargs: dict[str, JSON],
    *,
    generation: bool,
) -> str:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=False, **kwargs
    )


Encode = Callable[[str], list[int]]


def _boundaries(
    tokenizer: Tokenizer,
    messages: list[dict[str, JSON]],
    kwargs: dict[str, JSON],
    prompt: list[int],
    encode: Encode,
) -> dict[int, str]:
    boundaries: dict[int, str] = {}
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if 0 < n_system < len(messages):
        anchor = _boundary(tokenizer, messages[:n_system], kwargs, prompt, encode)
        if anchor:
            boundaries[anchor] = "anchor"
    if len(messages) > 1 and len(messages) - 1 != n_system:
        newest = _boundary(tokenizer, messages[:-1], kwargs, prompt, encode)
        if newest:
            boundaries.setdefault(newest, "message")
    return boundaries


def _boundary(
    tokenizer: Tokenizer,
    messages: list[dict[str, JSON]],
    kwargs: dict[str, JSON],
    prompt: list[int],
    encode: Encode,
) -> int | None:
    try:
        ids = encode(_render(tokenizer, messages, kwargs, generation=False))
    except Exception:  # a template may refuse a partial conversation; then there is no boundary
        return None
    if 0 < len(ids) < len(prompt) - 1 and prompt[: len(ids)] == ids:
        return len(ids)
    return None
