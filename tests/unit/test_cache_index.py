"""Radix token trie: compared against brute force on random workloads."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mlx_kvserve.cache.index import TokenIndex, common_prefix


def arr(xs):
    return np.asarray(xs, dtype=np.uint32)


def lcp(a, b):
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def brute_walk(entries, prompt, limit):
    """(trim_lcp, shallowest covering trimmable length, prefixes) by brute force."""
    trim = [(toks, k) for k, (toks, t) in entries.items() if t]
    trim_lcp = max((lcp(toks, prompt) for toks, _ in trim), default=0)
    usable = min(trim_lcp, limit)
    cover = sorted(len(toks) for toks, _ in trim if usable > 0 and lcp(toks, prompt) >= usable)
    prefixes = sorted(
        (len(toks), k)
        for k, (toks, _) in entries.items()
        if len(toks) <= len(prompt) and list(prompt[: len(toks)]) == list(toks)
    )
    return trim_lcp, (cover[0] if cover else 0), prefixes


def test_common_prefix():
    assert common_prefix(arr([1, 2, 3]), arr([1, 2, 4])) == 2
    assert common_prefix(arr([1, 2]), arr([1, 2, 4])) == 2
    assert common_prefix(arr([]), arr([1])) == 0
    assert common_prefix(arr([5]), arr([1])) == 0


def test_basic_walk():
    idx = TokenIndex()
    idx.insert(arr([1, 2, 3, 4]), "a", True)
    idx.insert(arr([1, 2, 9]), "b", True)
    idx.insert(arr([1, 2]), "c", False)
    w = idx.walk(arr([1, 2, 3, 7, 7]), limit=4)
    assert w.trim_lcp == 3 and w.trim_key == "a" and w.trim_key_len == 4
    assert w.prefixes == [(2, "c")]
    # Capped at limit: the shallowest entry covering two tokens is b (3 tokens) or a (4).
    w = idx.walk(arr([1, 2, 3]), limit=2)
    assert w.trim_key == "b" and w.trim_key_len == 3
    assert idx.remove(arr([1, 2, 9]), "b")
    w = idx.walk(arr([1, 2, 3]), limit=2)
    assert w.trim_key == "a"
    assert not idx.remove(arr([1, 2, 9]), "b")
    assert len(idx) == 2


@pytest.mark.parametrize("seed", range(6))
def test_random_against_brute_force(seed):
    rng = random.Random(seed)
    idx = TokenIndex()
    entries: dict[str, tuple[tuple[int, ...], bool]] = {}
    base = [rng.randrange(4) for _ in range(40)]
    for step in range(300):
        if entries and rng.random() < 0.3:
            key = rng.choice(sorted(entries))
            toks, _ = entries.pop(key)
            assert idx.remove(arr(toks), key)
        else:
            cut = rng.randrange(1, 30)
            toks = tuple(base[:cut] + [rng.randrange(4) for _ in range(rng.randrange(0, 6))])
            if any(t == toks for t, _ in entries.values()):
                continue
            key = f"k{step}"
            trimmable = rng.random() < 0.7
            entries[key] = (toks, trimmable)
            assert idx.insert(arr(toks), key, trimmable) is None
        assert len(idx) == len(entries)
        for _ in range(3):
            prompt = tuple(base[: rng.randrange(0, 40)] + [rng.randrange(4)])
            limit = max(0, len(prompt) - 1)
            w = idx.walk(arr(prompt), limit)
            trim_lcp, cover_len, prefixes = brute_walk(entries, prompt, limit)
            assert w.trim_lcp == trim_lcp
            assert w.trim_key_len == cover_len
            if w.trim_key is not None:
                assert entries[w.trim_key][1]
                assert lcp(entries[w.trim_key][0], prompt) >= min(trim_lcp, limit)
            assert sorted(w.prefixes) == prefixes
    assert sorted(idx.keys()) == sorted(entries)


def test_compact_after_removals():
    idx = TokenIndex()
    for i in range(50):
        idx.insert(arr([1, 2, 3, i, i]), f"k{i}", True)
    for i in range(50):
        idx.remove(arr([1, 2, 3, i, i]), f"k{i}")
    assert len(idx) == 0 and idx.node_count() == 1
