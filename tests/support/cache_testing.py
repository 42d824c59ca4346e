"""Synthetic mlx-lm caches for tests and benchmarks of the prompt cache (no model needed).

KV for position p is a deterministic function of (seed, layer, p) only, the way a causal model's
KV depends only on the tokens up to p, so two caches "prefilled" over the same positions hold the
same values however they were chunked, and restore results can be compared bit for bit.
"""

from __future__ import annotations

import errno
import threading
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


def poison_entry(path: Path) -> None:
    """Rewrite an entry file so that it passes every load check (finite values, checksums that
    match) but holds keys and values of the largest finite magnitude: a prefill from it gives
    non-finite logits (the ds4 #253 case: only the logits show it)."""
    from mlx_kvserve.cache import codec

    raw = path.read_bytes()
    header_len, digest, slot = codec.parse_prefix(raw[: codec.PREFIX_SIZE])
    header = codec.parse_header(raw[codec.PREFIX_SIZE : codec.PREFIX_SIZE + header_len], digest)
    arrays = codec.decode_payload(memoryview(raw)[codec.payload_start(header_len) :], header)
    huge = [_huge(a) for a in arrays]
    specs, size = codec.array_specs(huge)
    header.update(arrays=specs, payload_bytes=size, payload_sha256=codec.payload_digest(huge))
    payload = b"".join(codec.byte_view(a.data).tobytes() for a in huge)
    path.write_bytes(codec.pack_head(header, slot or codec.Slot()) + payload)


# Nearly the largest finite value of each float dtype, as stored (bfloat16: its uint16 bits),
# its sign alternating along the sequence axis of KV arrays (batch, heads, positions, dim): some
# position's score overflows in every head whatever the query, where one sign for all lets the
# norms saturate to finite zeros instead (a state no check can see).
_LARGEST = {"float32": 3.4e38, "float16": 65000.0, "bfloat16": 0x7F7F}


def _huge(a: Any) -> Any:
    from mlx_kvserve.cache.codec import DTYPES, HostArray

    if a.dtype not in _LARGEST:
        return HostArray(a.name, a.dtype, a.shape, np.array(a.data))
    data = np.full(a.shape, _LARGEST[a.dtype], DTYPES[a.dtype])
    if data.ndim >= 3:
        if a.dtype == "bfloat16":
            data[:, :, 1::2] |= 0x8000  # the sign bit
        else:
            data[:, :, 1::2] *= -1
    return HostArray(a.name, a.dtype, a.shape, data.reshape(a.data.shape))


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


# -- a failing disk ---------------------------------------------------------------------------
def inject_faults(monkeypatch: Any, spec: str) -> None:
    """Arm the named fault points (`MLX_KVSERVE_FAULTS` syntax, e.g. "disk_fsync_eio@2"),
    counting every point's occurrences from zero again; "" disarms them."""
    from mlx_kvserve.engine import faults

    monkeypatch.setenv(faults.ENV, spec)
    monkeypatch.setattr(faults, "_rules", None)
    monkeypatch.setattr(faults, "_calls", {})


class SmallDisk:
    """A file system of `total` bytes around a real cache directory, for in-process tests (a
    real small file system needs mount rights; tests/server mounts a tmpfs where it can): its
    free space is what the directory's files and `filler` bytes leave, and an entry write that
    does not fit fails with ENOSPC, as a full disk's would. The seam is `DiskTier.usage` and
    `DiskTier.write_entry`; everything else is the real disk tier."""

    def __init__(self, directory: Path, total: int) -> None:
        self.directory = Path(directory)
        self.total = total
        self.filler = 0
        self.writes = threading.Event()  # cleared: entry writes wait (jobs pile up in the queue)
        self.writes.set()
        self.waiting = threading.Event()  # set once an entry write waits for `writes`

    def used(self) -> int:
        if not self.directory.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())

    def free(self) -> int:
        return max(0, self.total - self.filler - self.used())

    def fill(self, leave: int = 0) -> None:
        """Another program fills the file system, leaving `leave` bytes free."""
        self.filler = 0
        self.filler = max(0, self.total - self.used() - leave)

    def install(self, monkeypatch: Any) -> None:
        from mlx_kvserve.cache.disk import DiskTier

        disk = self
        real_write = DiskTier.write_entry

        def usage(self: DiskTier) -> tuple[int, int]:
            return disk.total, disk.free()

        def write_entry(self: DiskTier, key, head, arrays, job) -> int:  # noqa: ANN001
            if not disk.writes.is_set():
                disk.waiting.set()
            disk.writes.wait(30)
            if len(head) + sum(a.nbytes for a in arrays) > disk.free():
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(self, key, head, arrays, job)

        monkeypatch.setattr(DiskTier, "usage", usage)
        monkeypatch.setattr(DiskTier, "write_entry", write_entry)


def settle(cache: Any) -> dict:
    """Every queued disk job done and every result applied (the writer has forgotten the keys
    of failed writes too); returns the cache's stats."""
    cache.flush()
    cache.stats()
    cache.flush()
    return cache.stats()


def entry_files(cache: Any) -> set[str]:
    """Keys of the entry files in a PromptCache's directory."""
    return {p.name[: -len(".kvc")] for p in cache.disk.dir.glob("*.kvc")}


def assert_disk_consistent(cache: Any) -> dict:
    """Once settled, the disk, the index and the bookkeeping agree: one file per written entry
    (plus the files marked evicted that could not be deleted), no temporary file, nothing
    pending, pinned or remembered as unwritten. Returns the stats."""
    stats = settle(cache)
    infos = cache.entries()
    written = {e.key for e in infos if e.disk == "written"}
    assert entry_files(cache) == written | set(cache.disk.undeleted)
    assert stats["disk_bytes"] == sum(e.file_bytes for e in infos if e.disk == "written")
    assert stats["pending_writes"] == 0 and stats["pending_bytes"] == 0
    assert stats["pinned"] == 0 and cache._writer.unwritten == 0
    assert [p.name for p in cache.disk.dir.iterdir() if p.name.startswith(".tmp.")] == []
    return stats
