#!/usr/bin/env python3
"""What Qwen's M-RoPE costs the text model's passes (docs/images.md, "Qwen's M-RoPE"), in this
process, on a random-weight Qwen2.5-VL-shaped text model (mlx-lm's `qwen2_vl`, float32).

    python scripts/bench_mrope.py [--rounds 20] [--layers 4] [--hidden 512]

1. A decode step of 1 and of 4 rows over a 1,024-token KV: mlx-lm's rope as loaded, the M-RoPE
   layers installed with text-only rows (no context: the original rope, untouched), and rows
   past an image (each row's delta added to its offset).
2. A 512-token prefill chunk holding a 16 x 20 image (320 tokens): 1D positions against the
   explicit (t, h, w) positions (mlx-vlm's rotary, cos and sin once per pass).
3. `prompt_positions` of a 32k-token prompt with 8 images of 1,200 tokens (once per chunk).

Medians over rounds; the figures go to docs/images.md with the command and the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models import qwen2_vl  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: E402

from mlx_kvserve.images.spans import ImageSpan  # noqa: E402
from mlx_kvserve.vision.mrope import install_mrope, prompt_positions  # noqa: E402

KV = 1024


def config(layers: int, hidden: int) -> dict:
    heads = hidden // 64
    return {
        "model_type": "qwen2_5_vl",
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 8),
        "rms_norm_eps": 1e-6,
        "vocab_size": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 8, 8]},
        "tie_word_embeddings": False,
    }


def median_ms(fn, rounds: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def prefilled(model, rows: int) -> list:
    caches = []
    for r in range(rows):
        cache = [KVCache() for _ in model.layers]
        tokens = mx.array([[(7 * i + r) % 30000 for i in range(KV)]])
        mx.eval(model.language_model.model(tokens, cache=cache))  # (no logits: the KV only)
        caches.append(cache)
    return caches


def decode_step(model, caches: list, rows: int):  # noqa: ANN201
    if rows == 1:
        cache = caches[0]

        def step() -> None:
            mx.eval(model(mx.array([[11]]), cache=cache))
            for c in cache:
                c.trim(1)

        return step
    merged = [BatchKVCache.merge([c[i] for c in caches]) for i in range(len(model.layers))]

    def step_many() -> None:
        mx.eval(model(mx.array([[11]] * rows), cache=merged))
        for c in merged:
            c.trim(1)

    return step_many


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    cfg = config(args.layers, args.hidden)
    model = qwen2_vl.Model(qwen2_vl.ModelArgs.from_dict(dict(cfg)))
    mx.eval(model.parameters())

    steps = {rows: decode_step(model, prefilled(model, rows), rows) for rows in (1, 4)}
    plain = {rows: median_ms(step, args.rounds) for rows, step in steps.items()}
    positions = install_mrope(model, "qwen2_5_vl", cfg)
    text = {rows: median_ms(step, args.rounds) for rows, step in steps.items()}
    shifted = {}
    for rows, step in steps.items():
        with positions.rows([-280 - r for r in range(rows)]):
            shifted[rows] = median_ms(step, args.rounds)
    print(f"| decode step, {args.layers} layers x {args.hidden}, {KV}-token KV | 1 row | 4 rows |")
    print("|---|---:|---:|")
    print(f"| mlx-lm's rope | {plain[1]:.2f} ms | {plain[4]:.2f} ms |")
    print(f"| M-RoPE installed, text rows | {text[1]:.2f} ms | {text[4]:.2f} ms |")
    print(f"| M-RoPE, rows past an image | {shifted[1]:.2f} ms | {shifted[4]:.2f} ms |")

    chunk = 512
    span = ImageSpan(100, 320, "0" * 64)
    ids = prompt_positions(chunk, [span], [(1, 16, 20)])
    tokens = mx.array([[(5 * i) % 30000 for i in range(chunk)]])

    def prefill(explicit: bool):  # noqa: ANN202
        def run() -> None:
            cache = [KVCache() for _ in model.layers]
            inner = model.language_model.model  # the layers' work, not the vocabulary's
            if explicit:
                with positions.chunk(ids, 0):
                    mx.eval(inner(tokens, cache=cache))
            else:
                mx.eval(inner(tokens, cache=cache))

        return run

    flat, grid = median_ms(prefill(False), args.rounds), median_ms(prefill(True), args.rounds)
    print(f"\n| {chunk}-token prefill chunk with a 16 x 20 image | median |")
    print("|---|---:|")
    print(f"| 1D positions (mlx-lm's rope) | {flat:.1f} ms |")
    print(f"| explicit (t, h, w) positions | {grid:.1f} ms |")

    n, size, length = 8, 1200, 32000
    gap = length // (n + 1)
    spans = [ImageSpan(gap * (i + 1) - size // 2, size, f"{i:064x}") for i in range(n)]
    grids = [(1, 30, 40)] * n
    cost = median_ms(lambda: prompt_positions(length, spans, grids), args.rounds)
    print(f"\nprompt_positions, {length} tokens with {n} images of {size}: {cost:.2f} ms")


if __name__ == "__main__":
    main()
