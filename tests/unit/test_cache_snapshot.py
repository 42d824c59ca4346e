"""Entries of caches other than plain KVCache: windows, SSM states, hybrids, quantized KV."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlx_kvserve.cache import CacheRestoreError, PromptCache
from tests.support.cache_testing import (
    fill_kv,
    make_hybrid,
    make_rotating,
    make_ssm,
    state_arrays,
)

MiB = 1 << 20
T = list(range(40, 140))


def open_cache(path):
    return PromptCache(path, "model-s", disk_budget=64 * MiB, ram_budget=64 * MiB)


def assert_same_state(got, want):
    a, b = state_arrays(got), state_arrays(want)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y)


def roundtrip(tmp_path, caches, fresh, n, *, restart=True, kind="snapshot"):
    pc = open_cache(tmp_path)
    key = pc.checkpoint(T[:n], caches, "message")
    assert key is not None
    assert {e.kind for e in pc.entries()} == {kind}
    if restart:
        pc.close()
        pc = open_cache(tmp_path)
    m = pc.lookup(T[: n + 1])
    assert m.key == key and m.usable == n and m.kind == kind
    pc.restore(m, fresh, tokens=T[: n + 1])
    pc.close()
    return fresh


@pytest.mark.parametrize("n", [5, 16, 40])  # inside, at, and beyond the window
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_rotating_window(tmp_path, n, dtype):
    live = make_rotating(n, max_size=16, keep=2, dtype=dtype)
    fresh = [RotatingKVCache(max_size=16, keep=2) for _ in range(2)]
    roundtrip(tmp_path, live, fresh, n)
    for a, b in zip(fresh, live, strict=True):
        assert (a.offset, a._idx, a.keep, a.max_size) == (b.offset, b._idx, b.keep, b.max_size)
    assert_same_state(fresh, live)
    # Decoding on from the restored state matches decoding on from the live one.
    fill_kv(fresh, n, n + 5, chunk=1, dtype=dtype)
    fill_kv(live, n, n + 5, chunk=1, dtype=dtype)
    for a, b in zip(fresh, live, strict=True):
        for x, y in zip(a.keys_and_values(), b.keys_and_values(), strict=True):
            assert mx.array_equal(x, y).item()


def test_rotating_window_size_mismatch_refused(tmp_path):
    live = make_rotating(20, max_size=16)
    with pytest.raises(CacheRestoreError):
        roundtrip(tmp_path, live, [RotatingKVCache(max_size=32) for _ in range(2)], 20)


def test_ssm_arrays_cache(tmp_path):
    live = make_ssm(30)
    fresh = roundtrip(tmp_path, live, [ArraysCache(size=2) for _ in range(2)], 30)
    assert_same_state(fresh, live)


def test_hybrid_model(tmp_path):
    live = make_hybrid(30)
    fresh = roundtrip(tmp_path, live, [ArraysCache(size=2), KVCache()], 30)
    assert_same_state(fresh, live)
    # Restored with KVCache's free room after the positions (the padding is not stored)
    assert fresh[1].offset == 30 and fresh[1].keys.shape[2] == 256
    fill_kv(fresh[1:], 30, 31)  # still a working KVCache


def test_quantized_kv(tmp_path):
    live = [QuantizedKVCache(group_size=32, bits=8) for _ in range(2)]
    fill_kv(live, 0, 20, head_dim=64)
    fresh = roundtrip(
        tmp_path,
        live,
        [QuantizedKVCache(group_size=32, bits=8) for _ in range(2)],
        20,
        kind="delta",
    )
    for a, b in zip(fresh, live, strict=True):
        for x, y in zip(a.keys_and_values(), b.keys_and_values(), strict=True):
            for p, q in zip(x, y, strict=True):
                assert mx.array_equal(p, q).item()


def test_layer_class_mismatch_refused(tmp_path):
    live = make_ssm(10)
    with pytest.raises(CacheRestoreError):
        roundtrip(tmp_path, live, [KVCache(), KVCache()], 10, restart=False)
