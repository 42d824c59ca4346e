"""HoleKVCache (engine/speculation/holes.py): rows of a merged batch give back their own newest
slots as holes, over many rounds, while rows join (`extend`) and leave (`extract`, `filter`),
and every row continues exactly as its own cache fed only the tokens it kept."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlx_kvserve.engine.speculation.holes import HoleKVCache
from mlx_kvserve.engine.speculation.rewind import roll_back
from tests.unit.test_engine_units import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def solo(model, prompt: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    return cache


def test_rows_continue_like_their_own_caches_through_rounds_joins_and_leaves(model):
    rng = random.Random(4)
    prompts = [
        [rng.randrange(1, 90) for _ in range(n)] for n in (9, 17, 5, 60)
    ]  # the last joins, longer
    # the last prompt joins later, longer than the batch; the reference: one cache per row
    own = [solo(model, p) for p in prompts[:3]]
    merged = [
        BatchKVCache.merge(list(layer))
        for layer in zip(*[solo(model, p) for p in prompts[:3]], strict=True)
    ]
    rows = [0, 1, 2]  # which reference each merged row is
    for round_ in range(9):
        if round_ == 3:  # a row joins: a fresh merged single, extended into the batch
            own.append(solo(model, prompts[3]))
            single = [BatchKVCache.merge([c]) for c in solo(model, prompts[3])]
            for c, s in zip(merged, single, strict=True):
                c.extend(s)
            rows.append(3)
        if round_ in (5, 6):  # a row leaves: its extracted cache holds exactly its kept tokens
            # first a left-padded row with holes, then the longest (the batch's padding shrinks)
            leaving = rows.index(0 if round_ == 5 else 3)
            for c, ref in zip(merged, own[rows[leaving]], strict=True):
                got = c.extract(leaving)
                assert got.offset == ref.offset
                want = ref.keys[..., : ref.offset, :]
                assert mx.allclose(got.keys[..., : got.offset, :], want, atol=1e-5).item()
            keep = [i for i in range(len(rows)) if i != leaving]
            for c in merged:
                c.filter(keep)
            rows = [rows[i] for i in keep]
        fed = [[rng.randrange(1, 90) for _ in range(5)] for _ in rows]
        rejected = [rng.randrange(0, 5) for _ in rows]
        model(mx.array(fed), cache=merged)
        roll_back(merged, rejected)
        for f, r, i in zip(fed, rejected, rows, strict=True):
            model(mx.array([f[: len(f) - r]]), cache=own[i])
        nxt = [rng.randrange(1, 90) for _ in rows]
        got = model(mx.array(nxt)[:, None], cache=merged)[:, -1]
        for b, (t, i) in enumerate(zip(nxt, rows, strict=True)):
            want = model(mx.array([[t]]), cache=own[i])[0, -1]
            assert mx.allclose(got[b], want, atol=1e-4).item(), (round_, i)
    assert all(isinstance(c, HoleKVCache) and c.valid is not None for c in merged)
