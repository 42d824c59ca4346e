"""Verification (engine/speculation/verify.py): greedy acceptance, and sampled acceptance whose
tokens are distributed as the row's own sampler's, seeded rows as without speculation."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvserve.engine import sampling
from mlx_kvserve.engine.decode import Decoder
from mlx_kvserve.engine.requests import GenerationRequest, SamplingParams
from mlx_kvserve.engine.speculation.verify import accepted_lengths, verify


def decoder(**params: float | int | None) -> Decoder:
    return Decoder(GenerationRequest([1], SamplingParams(**params)))  # type: ignore[arg-type]


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` (cells with p > 0), and its df; a count
    in a cell of probability 0 fails outright."""
    assert counts[probs == 0].sum() == 0, "drew a token the sampler never draws"
    live = probs > 0
    expected = probs[live] * counts.sum()
    return float(((counts[live] - expected) ** 2 / expected).sum()), int(live.sum()) - 1


def processed(logits: np.ndarray, temp: float, top_k: int) -> np.ndarray:
    """The sampler's distribution, written independently: top-k of the logprobs, softmax(x/T)."""
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    keep = np.argsort(-logprobs)[:top_k]
    x = np.full_like(logprobs, -np.inf)
    x[keep] = logprobs[keep] / temp
    p = np.exp(x - x[keep].max())
    return p / p.sum()


# -- greedy ----------------------------------------------------------------------------------
def test_greedy_keeps_the_prefix_equal_to_the_argmax_plus_the_next_token() -> None:
    mx.random.seed(0)
    logits = mx.random.normal((4, 4, 50))
    best = np.array(mx.argmax(logits, axis=-1)).tolist()
    wrong = (best[1][1] + 1) % 50
    drafts = [
        best[0][:3],  # all kept: three drafts and the bonus token
        [best[1][0], wrong, best[1][2]],  # the second draft is wrong
        [],  # nothing drafted: plain decoding
        best[3][:2],  # a shorter draft than the pass is wide
    ]
    rows = [decoder(temperature=0.0) for _ in range(4)]
    out = verify(rows, logits, drafts)
    assert out.accepted.tolist() == [3, 1, 0, 2]
    assert out.read() == [best[0], best[1][:2], best[2][:1], best[3][:3]]
    np.testing.assert_allclose(
        np.array(out.logprobs), np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    )


def test_padded_ids_and_masked_tokens_are_never_drawn() -> None:
    logits = mx.zeros((1, 2, 10))
    logits[..., 8:] = 50.0  # a checkpoint's padded embedding rows: the largest logits
    logits[..., 3] = 5.0
    logits[..., 4] = 4.0
    masks = mx.ones((1, 2, 8), dtype=mx.bool_)
    masks[0, 1, 3] = False  # a grammar forbids 3 after the first draft
    out = verify([decoder(temperature=0.0)], logits, [[3]], vocab=8, masks=masks)
    assert out.read() == [[3, 4]]
    assert out.logprobs.shape == (1, 2, 8)


def test_accepted_lengths_stop_at_the_first_miss_and_the_row_length() -> None:
    samples = mx.array([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 3, 4]])
    drafts = mx.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert accepted_lengths(samples, drafts, mx.array([3, 3, 1])).tolist() == [3, 1, 1]


# -- sampled ---------------------------------------------------------------------------------
LOGITS = [
    np.array([2.0, 1.6, 1.1, 0.4, 0.0, -0.7, 2.3, -3.0]),
    np.array([0.2, 2.5, -1.0, 1.9, 0.3, 1.2, 0.0, 0.8]),
]
TEMP, TOP_K = 0.8, 6


def test_sampled_tokens_are_distributed_as_the_sampler_draws() -> None:
    """Over many rows with one fixed seed: the first token is distributed as p0, the draft is
    kept with probability p0(d), a rejection draws from p0 without d, and after a kept draft the
    next token is distributed as p1."""
    n = 6000
    p0, p1 = (processed(x, TEMP, TOP_K) for x in LOGITS)
    d0, d1 = 1, 3  # p0(1) ~ 0.2, p1(3) ~ 0.3
    rows = [decoder(temperature=TEMP, top_k=TOP_K) for _ in range(n)]
    logits = mx.broadcast_to(mx.array(np.stack(LOGITS + [LOGITS[0]]))[None], (n, 3, 8))
    mx.random.seed(1234)
    out = verify(rows, logits, [[d0, d1]] * n)
    emitted = out.read()
    first = np.array([e[0] for e in emitted])
    kept = first == d0

    assert abs(kept.mean() - p0[d0]) < 4 * math.sqrt(p0[d0] * (1 - p0[d0]) / n)
    stat, df = chi2(np.bincount(first, minlength=8), p0)
    assert stat < chi2_critical(df), stat
    residual = p0.copy()
    residual[d0] = 0
    stat, df = chi2(np.bincount(first[~kept], minlength=8), residual / residual.sum())
    assert stat < chi2_critical(df), stat
    second = np.array([e[1] for e in emitted if len(e) > 1])
    assert len(second) == kept.sum()
    stat, df = chi2(np.bincount(second, minlength=8), p1)
    assert stat < chi2_critical(df), stat


def test_a_draft_the_sampler_never_draws_is_never_kept() -> None:
    p0 = processed(LOGITS[0], TEMP, TOP_K)
    never = int(np.argmin(p0))
    assert p0[never] == 0
    n = 500
    rows = [decoder(temperature=TEMP, top_k=TOP_K) for _ in range(n)]
    logits = mx.broadcast_to(mx.array(np.stack(LOGITS))[None], (n, 2, 8))
    out = verify(rows, logits, [[never]] * n)
    assert out.accepted.tolist() == [0] * n


@pytest.mark.parametrize("miss_at", [None, 0, 2])
def test_a_seeded_row_emits_what_it_would_without_speculation(miss_at: int | None) -> None:
    """Its position i is drawn from the seed of its token number draws + i: the tokens equal
    plain seeded decoding's, whatever the draft and whatever else shares the batch."""
    mx.random.seed(5)
    logits = mx.random.normal((5, 40)) * 2
    plain_row = decoder(temperature=1.0, top_p=0.9, seed=77)
    plain_row.draws = 3  # mid-answer
    plain = [
        sampling.read(sampling.sample([(plain_row, False)], logits[i : i + 1]))[0] for i in range(5)
    ]

    draft = plain[:4]
    if miss_at is not None:
        draft[miss_at] = (draft[miss_at] + 1) % 40
    seeded = decoder(temperature=1.0, top_p=0.9, seed=77)
    seeded.draws = 3
    company = [decoder(temperature=0.0), decoder(temperature=0.7, seed=3)]
    batch = mx.stack([mx.random.normal((5, 40)), logits, mx.random.normal((5, 40))])
    out = verify([company[0], seeded, company[1]], batch, [[1, 2], draft, []])
    emitted = out.read()[1]
    kept = 4 if miss_at is None else miss_at
    assert emitted == plain[: kept + 1]
    assert seeded.draws == 3  # the caller advances it by what was emitted
