"""A model's reasoning section: its markers, and the template variables that control it.

Markers are found as mlx-lm finds them (`mlx_lm.tokenizer_utils._infer_thinking`, exposed on its
`TokenizerWrapper` as `think_start` / `think_end` and their token ids): `<think>`/`</think>` and
the few other pairs it knows. Whether the answer starts inside the reasoning is read from the
end of the rendered prompt, as mlx-lm's server does: the generation prompt of DeepSeek-R1
distills and Qwen3.5/3.6 already opens `<think>`, so everything the model writes before
`</think>` is reasoning.

What a template understands is read from the template itself (the variables it uses), not from
a list of model names. The mapping, per variable the template reads:

| template variable  | families (their real templates) | set from                              |
|--------------------|---------------------------------|---------------------------------------|
| `enable_thinking`  | Qwen3, Qwen3.5/3.6, GLM-4.5/4.6 | on/off: `enabled`; effort "none" = off |
| `thinking`         | DeepSeek-V3.1                   | on/off, as for `enable_thinking`      |
| `reasoning_effort` | gpt-oss                         | effort: low / medium / high; off: low |

Templates that read none of them (DeepSeek-R1 distills, MiniMax-M2, Kimi K2 Thinking) always
reason; the controls are then ignored, except the budget, which works for every model with
markers. Explicit `chat_template_kwargs` win over this mapping, which wins over the server's
`--chat-template-kwargs` default.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import Thinking
from mlx_kvserve.chat.tokenizer import Tokenizer
from mlx_kvserve.json_value import JSON

# gpt-oss's template knows low / medium / high; the protocols' other levels map to the nearest.
_GPT_OSS_EFFORT = {
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}
ON_OFF_VARIABLES = ("enable_thinking", "thinking")


@dataclass(frozen=True)
class ThinkMarkers:
    """The reasoning section's opening and closing text and token ids."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    close_ids: tuple[int, ...]  # what a spent budget forces: the end marker as the model writes it


def markers_for(tokenizer: Tokenizer) -> ThinkMarkers | None:
    """The model's reasoning markers as mlx-lm detected them, or None for a model without."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tokenizer.think_start, tokenizer.think_end
    # `<think>` models end their reasoning as "\n</think>\n\n" (Qwen3, R1, GLM); others as the
    # bare marker.
    close = f"\n{end}\n\n" if end == "</think>" else end
    return ThinkMarkers(
        start,
        end,
        tuple(tokenizer.think_start_tokens),
        tuple(tokenizer.think_end_tokens),
        tuple(tokenizer.encode(close, add_special_tokens=False)),
    )


def opens_reasoning(markers: ThinkMarkers | None, prompt: list[int]) -> int | None:
    """Where the prompt's unclosed reasoning opens (the answer starts inside it), else None."""
    if markers is None:
        return None
    start = _rfind(prompt, markers.start_ids)
    return start if start > _rfind(prompt, markers.end_ids) else None


def reasoning_tail(markers: ThinkMarkers | None, prompt: list[int], within: int) -> int | None:
    """Where a reasoning block the generation prompt itself holds begins: open (the model
    reasons next) or closed and empty (thinking turned off: Qwen3's `<think>\n\n</think>\n\n`,
    Gemma 4's empty thought channel), within the prompt's last `within` tokens. Templates drop
    that block when the turn comes back as history, so the next prompt departs there."""
    if markers is None:
        return None
    start = _rfind(prompt, markers.start_ids)
    return start if start > 0 and len(prompt) - start <= within else None


def _rfind(tokens: list[int], seq: tuple[int, ...]) -> int:
    """The last position of `seq` in `tokens`, or -1 (list.index does the scanning: prompts are
    long)."""
    backwards, n, at = tokens[::-1], len(seq), 0
    while True:
        try:
            j = backwards.index(seq[0], at)
        except ValueError:
            return -1
        pos = len(tokens) - 1 - j
        if tuple(tokens[pos : pos + n]) == seq:
            return pos
        at = j + 1


def template_variables(tokenizer: Tokenizer) -> frozenset[str]:
    """The undeclared variables of the model's chat template (what it can be told)."""
    source = getattr(tokenizer, "chat_template", None)
    return _variables(source) if isinstance(source, str) else frozenset()


@functools.lru_cache(maxsize=4)
def _variables(source: str) -> frozenset[str]:
    try:
        import jinja2
        from jinja2 import meta

        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(source)))
    except Exception:  # a template jinja2 cannot parse on its own: no controls
        return frozenset()


def template_kwargs(
    variables: frozenset[str],
    thinking: Thinking,
    request_kwargs: dict[str, JSON],
    server_kwargs: dict[str, JSON],
) -> dict[str, JSON]:
    """The extra template variables: server default, then the mapped controls, then the
    request's own `chat_template_kwargs`."""
    mapped: dict[str, JSON] = {}
    enabled = thinking.enabled
    if enabled is None and thinking.effort is not None:
        enabled = thinking.effort != "none"
    if enabled is not None:
        for name in ON_OFF_VARIABLES:
            if name in variables:
                mapped[name] = enabled
    if "reasoning_effort" in variables and thinking.effort in _GPT_OSS_EFFORT:
        mapped["reasoning_effort"] = _GPT_OSS_EFFORT[thinking.effort]
    elif "reasoning_effort" in variables and enabled is False:
        mapped["reasoning_effort"] = "low"  # gpt-oss always reasons: as little as it can
    return {**server_kwargs, **mapped, **request_kwargs}


def _reserved() -> frozenset[str]:
    """apply_chat_template's own parameters, which template kwargs must not replace."""
    try:
        from transformers import PreTrainedTokenizerBase

        params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
        names = {p.name for p in params.values() if p.kind is not p.VAR_KEYWORD}
    except Exception:
        names = set()
    return frozenset(names | {"self", "conversation", "messages", "tools", "tokenize"})


RESERVED = _reserved()


def check_template_kwargs(kwargs: dict[str, JSON], param: str) -> None:
    """A 400 for a key that would change how the template is called rather than what it says."""
    for key in kwargs:
        if key in RESERVED:
            raise InvalidRequest(
                f"Invalid value for '{param}': {key!r} is a parameter of the template call, "
                "not a template variable.",
                param=f"{param}.{key}",
            )
