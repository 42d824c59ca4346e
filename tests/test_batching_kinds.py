"""Batched greedy equals solo greedy for every architecture whose caches merge, in-process on a
real Engine thread with tiny random-weight models of mlx-lm's own architectures: windows
(`BatchRotatingKVCache`), SSM states (`ArraysCache` rows), `CacheList`, MLA latent KV. Prompts of
different lengths slide past the tiny windows (32) and the rows join and leave at different
steps. A model whose caches cannot merge (llama4's ChunkedKVCache) runs one at a time, correctly.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvserve.cache.state import cache_offsets
from tests.support.tiny_models import make_model_dir
from tests.test_batching import Driver, serve_together
from tests.test_engine_units import reference, request, tokens_of

pytestmark = pytest.mark.slow

PROMPTS = [
    [(7 * i + 3) % 4000 + 100 for i in range(50)],
    [(11 * i + 5) % 4000 + 100 for i in range(9)],
    [(5 * i + 1) % 4000 + 100 for i in range(37)],
    [3000, 1000, 4000, 1000, 5000],
]
LENGTHS = [40, 30, 20, 25]
BATCHED = ["llama", "qwen3_5", "gemma3_text", "gpt_oss", "deepseek_v3", "mamba2", "falcon_h1"]


@pytest.mark.parametrize("name", [*BATCHED, "llama4"])
def test_batched_greedy_equals_solo_greedy(tmp_path, name):
    model = load(str(make_model_dir(tmp_path / name, name)))[0]
    mx.eval(model.parameters())
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    peaks = serve_together(model, reqs, prefill_step=16)
    for req, p, n in zip(reqs, PROMPTS, LENGTHS, strict=True):
        assert tokens_of(req.text) == reference(model, p, n), req.request_id
        assert req.done.completion_tokens == n
    if name in BATCHED:
        assert max(peaks.values()) >= 2
    else:
        assert set(peaks.values()) == {1}


@pytest.mark.parametrize("name", BATCHED)
def test_caches_leaving_a_batch_continue_like_a_solo_prefill(tmp_path, name):
    """`extract` hands each leaving row its own caches: they hold exactly its tokens (their
    checkpoint and its next turn build on them) and the next token's logits match a prefill."""
    model = load(str(make_model_dir(tmp_path / name, name)))[0]
    driver = Driver(model)
    reqs = [request(p, max_tokens=n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    driver.join(reqs[0])
    driver.join(reqs[1])
    driver.step()
    driver.join(reqs[2])
    driver.join(reqs[3])
    driver.drain()
    assert max(driver.sizes) >= 3
    for seq in driver.ended:
        tokens = seq.live.tokens
        assert set(cache_offsets(seq.live.caches)) <= {len(tokens)}
        got = model(mx.array([[11]]), cache=seq.live.caches)[:, -1, :]
        want = model(mx.array([[*tokens, 11]]), cache=make_prompt_cache(model))[:, -1, :]
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-3, rtol=1e-3)
