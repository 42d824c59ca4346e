"""Turning request bodies into prompt token ids, and finding the checkpoint boundaries in them.

A chat prompt has two boundaries worth a prompt-cache checkpoint: the end of the leading system
messages (an "anchor" that every conversation with the same system prompt shares) and the end of
everything before the newest message (where an edited last message or a branch restarts). Each
is found by rendering the chat template on that prefix of the messages; it counts only when its
tokens are an exact prefix of the full prompt's tokens.
"""

from __future__ import annotations

from typing import Any

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.schemas import ChatCompletionRequest, CompletionRequest


def _messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _boundary(tokenizer: Any, messages: list[dict[str, str]], prompt: list[int]) -> int | None:
    try:
        ids = _render(tokenizer, messages, generation=False)
    except Exception:  # a template may refuse a partial conversation; then there is no boundary
        return None
    if 0 < len(ids) < len(prompt) - 1 and prompt[: len(ids)] == ids:
        return len(ids)
    return None


def chat_prompt(tokenizer: Any, body: ChatCompletionRequest) -> tuple[list[int], dict[int, str]]:
    """Prompt tokens for a chat request and its checkpoint boundaries {position: reason}."""
    messages = _messages(body)
    try:
        prompt = _render(tokenizer, messages, generation=True)
    except Exception as exc:  # template errors are the request's fault (e.g. role order)
        raise APIError(
            400, f"The chat template rejected the messages: {exc}", param="messages"
        ) from None
    boundaries: dict[int, str] = {}
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if 0 < n_system < len(messages):
        anchor = _boundary(tokenizer, messages[:n_system], prompt)
        if anchor:
            boundaries[anchor] = "anchor"
    if len(messages) > 1 and len(messages) - 1 != n_system:
        newest = _boundary(tokenizer, messages[:-1], prompt)
        if newest:
            boundaries.setdefault(newest, "message")
    return prompt, boundaries


def text_prompt(tokenizer: Any, body: CompletionRequest) -> tuple[list[int], dict[int, str]]:
    """Prompt tokens for a text completion; it has no message structure to checkpoint at."""
    if not body.prompt:
        raise APIError(400, "Invalid value for 'prompt': it is empty.", param="prompt")
    return list(tokenizer.encode(body.prompt)), {}
