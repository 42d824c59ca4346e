#!/usr/bin/env python3
"""Disk-hit restore time against a plain cold read of the same bytes (no model, no server).

    python scripts/bench_restore.py                      # ~40, ~90, ~130 MiB chains, 5 repeats
    python scripts/bench_restore.py --sizes 130 --repeats 3

Synthetic KV of the default model's geometry (30 layers, k/v (1, 3, T, 64) float32: 46,080
bytes per token) is checkpointed through the real `PromptCache` as a delta chain of `--links`
files, the cache is reopened with no RAM tier, and each repeat then:

* drops the page cache (`/proc/sys/vm/drop_caches`, else `posix_fadvise(DONTNEED)` per file)
  and times `PromptCache.restore` into fresh KVCache layers (read, checksum, NaN/Inf check,
  hand-over to MLX), wall time and the CPU time of all its threads (on a busy machine the wall
  time follows the CPU time), then the same restore again with the files in the page cache;
* drops the page cache again and times a plain cold read of the same files (whole files,
  headers too) into a buffer touched beforehand, then the same read warm.

Prints medians and the restore / cold-read ratio; the restore is checked bit for bit once.
Page faults on fresh memory are a large part of a restore on a small VM: `--mlx-cache-limit`
chooses between fresh buffers for every restore and buffers recycled from the previous one.
Nothing here asserts on time. Run it alone: it empties the whole machine's page cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_lm.models.cache import KVCache  # noqa: E402

from mlx_kvserve.cache import PromptCache  # noqa: E402
from tests.support.cache_testing import kv_arrays, make_kv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pagecache import evict_page_cache  # noqa: E402

MiB = 1 << 20
LAYERS, HEADS, HEAD_DIM = 30, 3, 64
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * 4
FINGERPRINT = "bench-restore"


def plain_read(files: list[Path], buf: memoryview) -> int:
    """Read every file whole into `buf` (1 MiB reads, like a sequential copy)."""
    done = 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while True:
                got = f.readinto(buf[done : done + MiB])
                if not got:
                    break
                done += got
    return done


def build(directory: Path, n_tokens: int, links: int, seed: int) -> list[int]:
    """A delta chain of `links` files holding `n_tokens` positions; returns the prompt."""
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, 49_000, n_tokens + 1)]
    caches = make_kv(n_tokens, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, seed=seed)
    with PromptCache(directory, FINGERPRINT, disk_budget=1 << 40, ram_budget=0) as pc:
        for i in range(1, links + 1):
            pc.checkpoint(tokens[: n_tokens * i // links], caches, "message")
    return tokens


def restore_once(pc: PromptCache, tokens: list[int], n_tokens: int) -> tuple[float, float, list]:
    """(wall seconds, CPU seconds of every thread, restored caches)."""
    m = pc.lookup(tokens)
    assert m.usable == n_tokens and m.source == "disk", (m.usable, m.source)
    fresh = [KVCache() for _ in range(LAYERS)]
    cpu, started = time.process_time(), time.perf_counter()
    pc.restore(m, fresh, tokens=tokens)
    return time.perf_counter() - started, time.process_time() - cpu, fresh


def measure(root: Path, mib: int, links: int, repeats: int) -> dict[str, float]:
    n_tokens = mib * MiB // BYTES_PER_TOKEN
    directory = root / f"{mib}mib"
    tokens = build(directory, n_tokens, links, seed=mib)
    files = sorted((directory / FINGERPRINT).glob("*.kvc"))
    total = sum(p.stat().st_size for p in files)
    buf = np.ones(total, dtype=np.uint8)  # touched: the plain read pays no page faults
    view = memoryview(buf)
    names = ("restore", "restore_cpu", "warm_restore", "read", "warm_read")
    times: dict[str, list[float]] = {name: [] for name in names}
    with PromptCache(directory, FINGERPRINT, disk_budget=1 << 40, ram_budget=0) as pc:
        *_, got = restore_once(pc, tokens, n_tokens)  # first call costs; checked bit for bit
        want = make_kv(n_tokens, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, seed=mib)
        for a, b in zip(kv_arrays(got), kv_arrays(want), strict=True):
            assert np.array_equal(a, b)
        del got, want
        for _ in range(repeats):
            method = evict_page_cache(files)
            wall, cpu = restore_once(pc, tokens, n_tokens)[:2]  # caches freed at once
            times["restore"].append(wall)
            times["restore_cpu"].append(cpu)
            times["warm_restore"].append(restore_once(pc, tokens, n_tokens)[0])
            evict_page_cache(files)
            started = time.perf_counter()
            assert plain_read(files, view) == total
            times["read"].append(time.perf_counter() - started)
            started = time.perf_counter()
            plain_read(files, view)
            times["warm_read"].append(time.perf_counter() - started)
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update(mib=total / MiB, files=len(files), tokens=n_tokens)
    out["ratio"] = out["restore"] / out["read"]
    out["ratio_max"] = max(r / c for r, c in zip(times["restore"], times["read"], strict=True))
    print(f"  {mib} MiB: page cache emptied with {method}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="40,90,130", help="chain sizes in MiB")
    p.add_argument("--links", type=int, default=3, help="files per chain")
    p.add_argument("--repeats", type=int, default=5, help="samples per size (median)")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument(
        "--mlx-cache-limit",
        type=int,
        default=None,
        help="MLX buffer cache limit in MiB (default: MLX's own, so each restore gets fresh\n"
        "memory, as the first one after a restart does; 512: the server's, so each restore\n"
        "reuses the buffers the previous one freed)",
    )
    args = p.parse_args(argv)
    if args.mlx_cache_limit is not None:
        mx.set_cache_limit(args.mlx_cache_limit * MiB)
    limit = mx.set_cache_limit(0)  # read back, and put back unchanged
    mx.set_cache_limit(limit)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"MLX buffer cache limit: {limit / MiB:.0f} MiB")
    header = (
        "| chain | files | cold restore (CPU) | cold read | ratio (median, worst) "
        "| warm restore | warm read |"
    )
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for mib in (int(s) for s in args.sizes.split(",") if s):
            r = measure(Path(tmp), mib, args.links, args.repeats)
            rows.append(
                f"| {r['mib']:.1f} MiB ({r['tokens']} tok) | {r['files']} "
                f"| {r['restore']:.3f} s ({r['restore_cpu']:.3f} s) | {r['read']:.3f} s "
                f"| {r['ratio']:.2f}x, {r['ratio_max']:.2f}x "
                f"| {r['warm_restore']:.3f} s | {r['warm_read']:.3f} s |"
            )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(header)
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
