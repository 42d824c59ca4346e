#!/usr/bin/env python3
"""What keying images by their content costs the prompt cache (docs/images.md), in this process.

    python scripts/bench_image_keys.py [--rounds 5]

1. The key: `key_tokens` and `whole_spans` for an agent's prompt (32k tokens) holding 0, 1 and
   8 screenshots of 1,200 tokens each (Qwen's budget for a 1280x800 image), the work each
   request's lookup and each checkpoint adds.
2. The encoder-output cache (`PromptCache.features`): one image's features (1,200 x 2,048
   bf16, 4.7 MiB, a Qwen2.5-VL-7B tower's output) put, read from RAM, and read from disk after
   a restart (checksum and all), on a temporary cache directory.

The median over rounds; the figures go to docs/images.md with the command and the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from mlx_kvserve.cache import PromptCache  # noqa: E402
from mlx_kvserve.images.spans import ImageSpan, key_tokens, whole_spans  # noqa: E402

PROMPT_TOKENS = 32_000
IMAGE_TOKENS = 1_200
FEATURES = (IMAGE_TOKENS, 2_048)


def median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def keys(rounds: int) -> None:
    prompt = [(7 * i + 3) % 150_000 for i in range(PROMPT_TOKENS)]
    print("| images in a 32k-token prompt | key_tokens | whole_spans |")
    print("|---:|---:|---:|")
    for n in (0, 1, 8):
        step = PROMPT_TOKENS // (n + 1)
        spans = [
            ImageSpan(step * (i + 1) - IMAGE_TOKENS // 2, IMAGE_TOKENS, f"{i:064x}")
            for i in range(n)
        ]
        key = median_ms(lambda spans=spans: key_tokens(prompt, spans), rounds)
        cut = median_ms(lambda spans=spans: whole_spans(PROMPT_TOKENS // 2, spans), rounds)
        print(f"| {n} | {key:.2f} ms | {cut * 1000:.1f} us |")


def features(rounds: int) -> None:
    array = mx.random.normal(FEATURES).astype(mx.bfloat16)
    mx.eval(array)
    size = array.nbytes / 2**20
    puts, ram, disk = [], [], []
    with tempfile.TemporaryDirectory() as root:
        for r in range(rounds):
            digest = hashlib.sha256(f"round {r}".encode()).hexdigest()
            cache = PromptCache(Path(root), "bench", disk_budget=1 << 30, ram_budget=1 << 30)
            puts.append(median_ms(lambda c=cache, d=digest: c.features.put(d, array), 1))
            ram.append(median_ms(lambda c=cache, d=digest: c.features.get(d), 1))
            cache.close()  # waits for the write
            cache = PromptCache(Path(root), "bench", disk_budget=1 << 30, ram_budget=1 << 30)
            disk.append(median_ms(lambda c=cache, d=digest: mx.eval(c.features.get(d)), 1))
            cache.close()
    print(f"\n| features {FEATURES[0]}x{FEATURES[1]} bf16 ({size:.1f} MiB) | median |")
    print("|---|---:|")
    print(f"| put (host copy made, write queued) | {statistics.median(puts):.1f} ms |")
    print(f"| get from RAM | {statistics.median(ram) * 1000:.1f} us |")
    print(f"| get from disk after a restart (read, SHA-256) | {statistics.median(disk):.1f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    keys(args.rounds)
    features(args.rounds)


if __name__ == "__main__":
    main()
