"""An embedding is the model's last hidden state pooled over the input's tokens. ENGINE THREAD.

mlx-lm's models keep their transformer body, which ends with the final norm and returns the
hidden states the lm_head would read, under one of a few names: `model` (llama, qwen, gemma,
mistral and most others), `transformer` (gpt_bigcode, dbrx, qwen, openelm), `backbone` (mamba,
nemotron_h); vision wrappers put a whole language model under `language_model` first (gemma3,
qwen3_5, mistral3). A model with none of these, or whose body does not return one vector per
token, cannot embed here and says so (`NoHiddenStates`).

Rows of a batch are padded on the right. Attention is causal (and recurrent layers run left to
right), so a token never sees the padding after it: each row's states are those it has alone,
without a mask. Pooling: `mean` over the row's tokens (any generative model), `last` (the last
token: Qwen3-Embedding and other decoder embedding models), `first` (a CLS-pooled model).
Nothing here touches a KV cache or the prompt cache: the body runs without one.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

MEAN = "mean"
LAST = "last"
FIRST = "first"
ENCODER = "encoder"  # the model pools itself, as its config says (embed/encoder.py)
POOLINGS = (MEAN, LAST, FIRST, ENCODER)
BODY_NAMES = ("model", "transformer", "backbone")


class NoHiddenStates(Exception):
    """The model does not expose its last hidden state the way mlx-lm's models do."""


def _language_model(model: nn.Module) -> nn.Module:
    """The language model inside a vision wrapper (or the model itself)."""
    inner = model
    while isinstance(getattr(inner, "language_model", None), nn.Module):
        inner = inner.language_model
    return inner


def body_of(model: nn.Module) -> nn.Module | None:
    """The module that maps token ids to the last hidden states, or None."""
    inner = _language_model(model)
    for name in BODY_NAMES:
        body = getattr(inner, name, None)
        if isinstance(body, nn.Module):
            return body
    return None


def hidden_width(model: nn.Module | None) -> int | None:
    """The width of the model's hidden states as its args state it (None: unknown). Read from
    the model's plain Python args, so any thread may ask."""
    if model is None:
        return None
    inner = _language_model(model)
    args = getattr(inner, "args", None) or getattr(inner, "config", None)  # mlx-vlm: config
    width = getattr(args, "hidden_size", None)
    return width if isinstance(width, int) and width > 0 else None


def embed_rows(model: nn.Module, rows: list[list[int]], pooling: str) -> np.ndarray:
    """One forward pass of `rows` (each at least one token id), pooled: float32, one row per
    input, not normalised."""
    body = body_of(model)
    if body is None:
        raise NoHiddenStates(
            f"{type(model).__module__} has no transformer body ({', '.join(BODY_NAMES)}) "
            "to read hidden states from"
        )
    width = max(len(row) for row in rows)
    padded = mx.array([row + [0] * (width - len(row)) for row in rows], dtype=mx.int32)
    hidden = body(padded, cache=None)  # (mamba's body has no default for it)
    if not isinstance(hidden, mx.array) or hidden.ndim != 3 or hidden.shape[:2] != padded.shape:
        raise NoHiddenStates(f"{type(model).__module__}'s body does not return hidden states")
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if hidden.shape[-1] == vocab:
        raise NoHiddenStates(f"{type(model).__module__}'s body returns logits")
    lengths = mx.array([len(row) for row in rows])
    if pooling == LAST:
        pooled = hidden[mx.arange(len(rows)), lengths - 1].astype(mx.float32)
    elif pooling == FIRST:
        pooled = hidden[:, 0].astype(mx.float32)
    else:
        keep = (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.float32)
        summed = (hidden.astype(mx.float32) * keep[..., None]).sum(axis=1)
        pooled = summed / lengths[:, None].astype(mx.float32)
    mx.eval(pooled)
    return np.array(pooled, dtype=np.float32)


def normalized(vector: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """`vector` cut to its first `dimensions` (Matryoshka truncation), then scaled to length 1,
    as Ollama and OpenAI return them (a zero vector stays zero)."""
    cut = vector[:dimensions] if dimensions else vector
    norm = float(np.linalg.norm(cut))
    return (cut / norm).astype(np.float32) if norm > 0 else cut.astype(np.float32)
