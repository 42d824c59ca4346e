"""Log probabilities of a prompt's own tokens (echo with logprobs, as evaluation harnesses ask
for them). ENGINE THREAD.

The prompts of a batch are padded on the right and run through the model from position 0, in
chunks of columns over a fresh KV cache (mlx-lm's `make_prompt_cache`): attention is causal and
recurrent layers run left to right, so a token never sees the padding after it, and each row's
figures are the ones it has alone. Every position is scored, so nothing comes from the prompt
cache and nothing is written to it. The logits at position i give token i+1's log probability
(the first token has none) and the `top` most likely tokens there; logits past the tokenizer's
ids (a checkpoint's padded rows) belong to no token and are cut off before normalising, as the
sampler does (engine/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

MAX_TOP = 20  # the most alternatives a position reports (OpenAI's legacy `logprobs` limit)


@dataclass(frozen=True)
class PromptLogprobs:
    """One prompt's figures: `logprobs[i]` is token i+1's log probability given tokens 0..i;
    `top_ids[i]` / `top_logprobs[i]` the most likely tokens at that position, best first."""

    logprobs: np.ndarray  # (len - 1,) float32
    top_ids: np.ndarray  # (len - 1, k) int
    top_logprobs: np.ndarray  # (len - 1, k) float32


class PromptScoring:
    """One padded batch of prompts, scored a chunk of columns at a time (`step`), so that the
    engine can go on generating between chunks."""

    def __init__(
        self, model: nn.Module, rows: list[list[int]], top: int, vocab: int | None
    ) -> None:
        if not rows or any(not row for row in rows):
            raise ValueError("every prompt needs at least one token")
        self.model = model
        self.rows = rows
        self.top = max(0, min(top, MAX_TOP))
        self.vocab = vocab
        self.width = max(len(row) for row in rows)
        self.padded = mx.array(
            [row + [0] * (self.width - len(row)) for row in rows], dtype=mx.uint32
        )
        self.cache = make_prompt_cache(model)
        self.position = 0  # columns fed so far
        self._chosen: list[np.ndarray] = []
        self._ids: list[np.ndarray] = []
        self._values: list[np.ndarray] = []

    @property
    def done(self) -> bool:
        return self.position >= self.width - 1  # the last column predicts nothing asked for

    def step(self, budget: int) -> bool:
        """Feed the next columns (about `budget` token positions over the batch, at least
        one column); whether the batch is done."""
        if self.done:
            return True
        start = self.position
        end = min(self.width - 1, start + max(1, budget // len(self.rows)))
        logits = self.model(self.padded[:, start:end], cache=self.cache)
        if self.vocab is not None and self.vocab < logits.shape[-1]:
            logits = logits[..., : self.vocab]
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = self.padded[:, start + 1 : end + 1]
        chosen = mx.take_along_axis(logprobs, targets[..., None].astype(mx.int32), axis=-1)
        parts = [chosen[..., 0]]
        if self.top:
            ids = mx.argpartition(-logprobs, kth=self.top - 1, axis=-1)[..., : self.top]
            values = mx.take_along_axis(logprobs, ids, axis=-1)
            order = mx.argsort(-values, axis=-1)
            parts.append(mx.take_along_axis(ids, order, axis=-1))
            parts.append(mx.take_along_axis(values, order, axis=-1))
        mx.eval(parts)
        self._chosen.append(np.array(parts[0]))
        if self.top:
            self._ids.append(np.array(parts[1]))
            self._values.append(np.array(parts[2]))
        self.position = end
        return self.done

    def results(self) -> list[PromptLogprobs]:
        """Each prompt's figures, once `done`."""
        assert self.done
        n = len(self.rows)
        chosen = _joined(self._chosen, (n, 0), np.float32)
        ids = _joined(self._ids, (n, chosen.shape[1], self.top), np.int64)
        values = _joined(self._values, (n, chosen.shape[1], self.top), np.float32)
        out = []
        for i, row in enumerate(self.rows):
            used = len(row) - 1
            out.append(PromptLogprobs(chosen[i, :used], ids[i, :used], values[i, :used]))
        return out


def _joined(parts: list[np.ndarray], empty: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.concatenate(parts, axis=1) if parts else np.zeros(empty, dtype=dtype)


def score(
    model: nn.Module, rows: list[list[int]], top: int, vocab: int | None, budget: int = 512
) -> list[PromptLogprobs]:
    """All of `rows` at once (tests, the benchmark)."""
    scoring = PromptScoring(model, rows, top, vocab)
    while not scoring.step(budget):
        pass
    return scoring.results()
