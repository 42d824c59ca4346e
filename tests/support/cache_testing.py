"""Synthetic mlx-lm caches for tests and benchmarks of the prompt cache (no model needed).

KV for position p is a deterministic function of (seed, layer, p) only, the way a causal model's
KV depends only on the tokens up to p, so two caches "prefilled" over the same positions hold the
same values however they were chunked, and restore results can be compared bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache


def kv_rows(layer: int, start: int, end: int, *, heads: int, head_dim: int, seed: int) -> Any:
    """Deterministic (1, heads, end-start, head_dim) float32 keys and values for positions."""
    pos = np.arange(start, end, dtype=np.float64)[None, None, :, None]
    h = np.arange(heads, dtype=np.float64)[None, :, None, None]
    d = np.arange(head_dim, dtype=np.float64)[None, None, None, :]
    base = np.sin(pos * 0.37 + h * 1.3 + d * 0.11 + layer * 2.1 + seed * 0.7)
    keys = (base * 3.0).astype(np.float32)
    values = (np.cos(base * 5.0 + pos * 0.01) * 2.0).astype(np.float32)
    return keys, values


def fill_kv(
    caches: list,
    start: int,
    end: int,
    *,
    heads: int = 2,
    head_dim: int = 8,
    dtype: Any = mx.float32,
    seed: int = 0,
    chunk: int | None = None,
) -> list:
    """Append positions [start, end) to every layer via update_and_fetch, like a prefill."""
    step = chunk or max(1, end - start)
    for lo in range(start, end, step):
        hi = min(end, lo + step)
        for i, c in enumerate(caches):
            k, v = kv_rows(i, lo, hi, heads=heads, head_dim=head_dim, seed=seed)
            c.update_and_fetch(mx.array(k).astype(dtype), mx.array(v).astype(dtype))
    mx.eval([c.keys for c in caches if getattr(c, "keys", None) is not None])
    return caches


def make_kv(n: int, *, layers: int = 2, **kw: Any) -> list:
    """`layers` KVCaches holding positions [0, n)."""
    return fill_kv([KVCache() for _ in range(layers)], 0, n, **kw)


def make_rotating(n: int, *, layers: int = 2, max_size: int = 16, keep: int = 0, **kw: Any):
    caches = [RotatingKVCache(max_size=max_size, keep=keep) for _ in range(layers)]
    # Token-by-token, as decode does, so the window really rotates.
    return fill_kv(caches, 0, n, chunk=1, **kw)


def make_ssm(n: int, *, layers: int = 2, seed: int = 0) -> list:
    """ArraysCache layers whose state is a function of the token count (like an SSM state)."""
    caches = []
    for i in range(layers):
        c = ArraysCache(size=2)
        c[0] = mx.full((1, 3, 4), float(n) + i + seed, dtype=mx.float32)
        c[1] = mx.arange(8, dtype=mx.float32).reshape(1, 2, 4) * (n + 1) + seed
        caches.append(c)
    return caches


def make_hybrid(n: int, **kw: Any) -> list:
    """SSM layer + KV layer, as in hybrid (Qwen3.5 / Jamba style) models."""
    ssm = make_ssm(n, layers=1)
    kv = make_kv(n, layers=1, **kw)
    return [ssm[0], kv[0]]


def kv_arrays(caches: list) -> list[np.ndarray]:
    """Every layer's real-length keys and values as host arrays (bf16 as its bit pattern)."""
    out = []
    for c in caches:
        k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        for a in (k, v):
            out.append(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a))
    return out


def state_arrays(caches: list) -> list[np.ndarray]:
    """Every array in the caches' `state` (for snapshot comparisons)."""
    out: list[np.ndarray] = []

    def walk(x: Any) -> None:
        if isinstance(x, mx.array):
            out.append(np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x))
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)

    for c in caches:
        if type(c) is KVCache:
            walk(c.keys_and_values())
        elif type(c) is RotatingKVCache:
            walk(c._temporal_order(c.keys) if c.keys is not None else None)
            walk(c._temporal_order(c.values) if c.values is not None else None)
        else:
            walk(c.state)
    return out


def rebuild_benchmark(directory: Path, n_entries: int = 1000, tokens: int = 64) -> dict[str, float]:
    """Write `n_entries` independent small entries, reopen, and time the index rebuild."""
    from mlx_kvserve.cache.store import PromptCache

    fingerprint = "bench"
    cache = PromptCache(directory, fingerprint, disk_budget=1 << 40, ram_budget=0)
    caches = make_kv(tokens, layers=2)
    rng = np.random.default_rng(0)
    for _ in range(n_entries):
        toks = rng.integers(0, 50_000, size=tokens).tolist()
        cache.checkpoint(toks, caches, "bench")
    cache.close()
    started = time.perf_counter()
    reopened = PromptCache(directory, fingerprint, disk_budget=1 << 40, ram_budget=0)
    wall = time.perf_counter() - started
    n = len(reopened.entries())
    reopened.close()
    return {"entries": n, "open_seconds": wall, "rebuild_seconds": reopened.rebuild_seconds}
