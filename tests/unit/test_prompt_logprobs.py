"""Prompt log probabilities (engine/prompt_logprobs.py) against a plain mlx-lm forward of each
prompt alone: batched with prompts of other lengths (padded on the right), fed a few columns at
a time over a KV cache, on attention, sliding-window, recurrent and hybrid architectures, over a
padded vocabulary (the logits no token has are cut off before normalising)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvserve.engine.prompt_logprobs import score
from tests.support.tiny_models import ROWS, VOCAB, make_model_dir

ARCHITECTURES = ["llama", "gemma3_text", "mamba", "qwen3_next"]
ROWS_OF_TOKENS = [[5, 17, 300, 9, 44, 1000, 3], [12], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7] * 4]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from mlx_lm import load

    path: Path = make_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    loaded, _ = load(str(path))
    return loaded


def plain(model, row: list[int]) -> np.ndarray:
    """Each position's log probabilities over the tokenizer's ids, one forward of `row` alone."""
    logits = model(mx.array([row]))[0][:, :VOCAB].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.mark.parametrize("budget", [512, 5])
def test_a_batch_scores_each_prompt_as_its_own_forward(model, budget: int) -> None:
    got = score(model, ROWS_OF_TOKENS, top=3, vocab=VOCAB, budget=budget)
    assert ROWS > VOCAB  # the checkpoint's padded rows are there, and cut off
    for row, scored in zip(ROWS_OF_TOKENS, got, strict=True):
        want = plain(model, row)
        assert scored.logprobs.shape == (len(row) - 1,)
        expected = want[np.arange(len(row) - 1), row[1:]]
        np.testing.assert_allclose(scored.logprobs, expected, atol=1e-4)
        for j in range(len(row) - 1):
            best = np.argsort(-want[j])[:3]
            np.testing.assert_allclose(scored.top_logprobs[j], want[j][best], atol=1e-4)
            assert int(scored.top_ids[j, 0]) == int(best[0])
            assert np.all(scored.top_ids[j] < VOCAB)


def test_no_alternatives_asked_gives_none(model) -> None:
    (scored,) = score(model, ROWS_OF_TOKENS[:1], top=0, vocab=VOCAB)
    assert scored.top_ids.shape == (len(ROWS_OF_TOKENS[0]) - 1, 0)
