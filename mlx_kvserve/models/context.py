"""The model's context window, from its config.json as the checkpoint's authors state it.

mlx-lm's `ModelArgs` keep only the fields an architecture computes with, so the model object is
a poor source: gpt-oss's args have no `max_position_embeddings` at all, and the wrappers
(Qwen3.5/3.6, multimodal Gemma 3 conversions) keep theirs inside a `text_config` dict. The
config is read in this order, at the top level and then in `text_config` (or another nested
language-model config):

1. an explicit window: `max_position_embeddings`, `max_sequence_length`, `max_seq_len`,
   `seq_length`, `n_positions`, `n_ctx`, `context_length`;
2. a window derived from RoPE scaling, as gpt-oss states it: `initial_context_length` (or
   `rope_scaling.original_max_position_embeddings`) times `rope_scaling.factor`, or the initial
   length alone (real gpt-oss configs carry both `max_position_embeddings`, 131072, and this
   pair, 4096 x 32; the explicit field wins when present);
3. otherwise the model object's own args (mlx-lm's defaults for the architecture, e.g. Gemma 3's
   32768), the inner language model's included.

None if none of these states a positive integer: the server then says so at start-up, checks
no request against a window and caps an unbounded request at its default `max_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_kvserve.json_value import JSON

if TYPE_CHECKING:  # MLX is imported only after the BLAS preload (mlx_kvserve.blas)
    import mlx.nn as nn

EXPLICIT = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "n_ctx",
    "context_length",
)
NESTED = ("text_config", "language_config", "llm_config")


def _positive(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and value > 0 else None


def config_sections(config: dict[str, JSON]) -> list[dict[str, JSON]]:
    """The config's top level, then the language model's nested sections of a wrapper."""
    nested = [config[k] for k in NESTED if isinstance(config.get(k), dict)]
    return [config, *nested]


def _from_rope(section: dict[str, JSON]) -> int | None:
    rope = section.get("rope_scaling")
    rope = rope if isinstance(rope, dict) else {}
    base = _positive(section.get("initial_context_length")) or _positive(
        rope.get("original_max_position_embeddings")
    )
    if base is None:
        return None
    factor = rope.get("factor")
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor >= 1:
        return int(base * factor)
    return base


def context_from_config(config: dict[str, JSON]) -> int | None:
    """Rules 1 and 2 above over a parsed config.json."""
    sections = config_sections(config)
    for section in sections:
        for name in EXPLICIT:
            if (value := _positive(section.get(name))) is not None:
                return value
    for section in sections:
        if (value := _from_rope(section)) is not None:
            return value
    return None


def context_from_model(model: nn.Module) -> int | None:
    """Rule 3: the args of the model object, or of the language model inside a wrapper."""
    holders = [model, getattr(model, "language_model", None)]
    for holder in holders:
        args = getattr(holder, "args", None)
        if args is None:
            continue
        for name in EXPLICIT:
            if (value := _positive(getattr(args, name, None))) is not None:
                return value
    return None


def read_context_length(model_dir: Path | None, model: nn.Module | None = None) -> int | None:
    """The window of the model in `model_dir` (its config.json), else of `model`'s args."""
    if model_dir is not None:
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            config = None
        if isinstance(config, dict) and (value := context_from_config(config)) is not None:
            return value
    return context_from_model(model) if model is not None else None
