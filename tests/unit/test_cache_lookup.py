"""Lookup semantics (invariants 1 and 2): exact, prefix, longer, diverging, one token left."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_kvserve.cache import PromptCache
from tests.support.cache_testing import kv_arrays, make_kv, make_ssm

MiB = 1 << 20


@pytest.fixture(params=["disk", "ram"])
def cache(request, tmp_path):
    directory = tmp_path / "kv" if request.param == "disk" else None
    pc = PromptCache(directory, "model-a", disk_budget=64 * MiB, ram_budget=64 * MiB)
    yield pc
    pc.close()


PROMPT = list(range(1000, 1100))


def restore_equals(pc, match, n_expected, layers=2, dtype=mx.float32):
    fresh = [KVCache() for _ in range(layers)]
    pc.restore(match, fresh)
    assert all(c.offset == n_expected for c in fresh)
    ref = make_kv(n_expected, layers=layers, dtype=dtype)
    for got, want in zip(kv_arrays(fresh), kv_arrays(ref), strict=True):
        assert got.dtype == want.dtype
        assert np.array_equal(got, want)
    return fresh


def test_empty_cache_misses(cache):
    m = cache.lookup(PROMPT)
    assert m.key is None and m.usable == 0 and m.source is None
    assert cache.stats()["misses"] == 1


def test_exact_hit_leaves_one_token(cache):
    key = cache.checkpoint(PROMPT[:60], make_kv(60), "turn")
    assert key is not None
    m = cache.lookup(PROMPT[:60])
    assert m.key == key and m.usable == 59 and m.kind == "delta"
    restore_equals(cache, m, 59)


def test_prefix_hit(cache):
    key = cache.checkpoint(PROMPT[:60], make_kv(60), "turn")
    m = cache.lookup(PROMPT)
    assert (m.key, m.usable, m.source) == (key, 60, "ram")
    restore_equals(cache, m, 60)


def test_longer_entry_trimmed_to_prompt(cache):
    key = cache.checkpoint(PROMPT[:80], make_kv(80), "turn")
    m = cache.lookup(PROMPT[:30])
    assert m.key == key and m.usable == 29 and m.entry_tokens == 80
    restore_equals(cache, m, 29)


def test_diverging_entry_trimmed_to_common_prefix(cache):
    cache.checkpoint(PROMPT[:80], make_kv(80), "turn")
    edited = PROMPT[:45] + [7, 7, 7] + PROMPT[48:]
    m = cache.lookup(edited)
    assert m.usable == 45
    restore_equals(cache, m, 45)


def test_divergence_at_first_token_is_a_miss(cache):
    cache.checkpoint(PROMPT[:80], make_kv(80), "turn")
    assert cache.lookup([5] + PROMPT[1:]).usable == 0


@pytest.mark.parametrize("n", [0, 1])
def test_prompts_too_short_to_reuse(cache, n):
    cache.checkpoint(PROMPT[:1], make_kv(1), "turn")
    assert cache.lookup(PROMPT[:n]).usable == 0


def test_usable_never_exceeds_prompt_minus_one(cache):
    cache.checkpoint(PROMPT[:50], make_kv(50), "a")
    cache.checkpoint(PROMPT[:50] + [1, 2, 3], make_kv(53), "b")
    for n in range(0, 60):
        m = cache.lookup((PROMPT[:50] + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])[:n])
        assert m.usable <= max(0, n - 1)


def test_prefers_longest_common_prefix_across_branches(cache):
    base = make_kv(90)
    cache.checkpoint(PROMPT[:40], make_kv(40), "a")
    k2 = cache.checkpoint(PROMPT[:90], base, "b")
    m = cache.lookup(PROMPT[:70] + [1])
    assert m.key == k2 and m.usable == 70


def test_restore_checks_prompt_tokens(cache):
    from mlx_kvserve.cache import CacheRestoreError

    cache.checkpoint(PROMPT[:60], make_kv(60), "turn")
    m = cache.lookup(PROMPT)
    with pytest.raises(CacheRestoreError):
        cache.restore(m, [KVCache(), KVCache()], tokens=[0] + PROMPT[1:])
    with pytest.raises(ValueError):
        cache.restore(m, [KVCache(), KVCache()], tokens=PROMPT[:60])
    restore_equals(cache, m, 60)


def test_snapshot_entries_need_an_exact_prefix(cache):
    key = cache.checkpoint(PROMPT[:20], make_ssm(20), "turn")
    assert key is not None
    assert cache.lookup(PROMPT[:21]).usable == 20
    assert cache.lookup(PROMPT).key == key
    assert cache.lookup(PROMPT[:20]).usable == 0  # would leave nothing to prefill
    assert cache.lookup(PROMPT[:15]).usable == 0  # shorter prompt: not trimmable
    assert cache.lookup(PROMPT[:10] + [1] * 20).usable == 0  # diverges inside the entry


def test_restore_into_wrong_cache_types_fails_cleanly(cache):
    from mlx_kvserve.cache import CacheRestoreError

    cache.checkpoint(PROMPT[:60], make_kv(60), "turn")
    m = cache.lookup(PROMPT)
    with pytest.raises(CacheRestoreError):
        cache.restore(m, [KVCache(), KVCache(), KVCache()])


def test_refuses_caches_of_another_length(cache):
    assert cache.checkpoint(PROMPT[:61], make_kv(60), "turn") is None
    assert cache.stats()["entries"] == 0


def test_duplicate_and_dominated_checkpoints_store_nothing(cache):
    assert cache.checkpoint(PROMPT[:60], make_kv(60), "a") is not None
    assert cache.checkpoint(PROMPT[:60], make_kv(60), "b") is None
    assert cache.checkpoint(PROMPT[:30], make_kv(30), "c") is None  # the 60 already serves it
    s = cache.stats()
    assert s["entries"] == 1 and s["duplicates"] == 1 and s["dominated"] == 1


def test_hit_accounting(cache):
    cache.checkpoint(PROMPT[:60], make_kv(60), "a")
    cache.lookup(PROMPT)
    cache.lookup([1, 2, 3])
    s = cache.stats()
    assert s["hits"] == 1 and s["misses"] == 1 and s["hit_rate"] == 0.5
    assert s["cached_tokens"] == 60
