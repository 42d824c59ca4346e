#!/usr/bin/env python3
"""Embeddings per second through the server against a plain mlx-lm forward of the same batch.

    python scripts/bench_embeddings.py                  # default model, 32 inputs, 5 rounds
    python scripts/bench_embeddings.py --inputs 64 --words 60 --rounds 3
    python scripts/bench_embeddings.py --encoder DIR    # a BERT-family model (the extra)

The server (`mlx-kvserve serve`, default model, prompt cache off) answers `/v1/embeddings` for
the batch, float encoding; this process loads the same model directory with `mlx_lm.load` and
runs the same token rows, padded on the right into one array, through the model's body
(`model.model`), then the mean over each row's tokens, evaluated: what the server computes,
without HTTP, tokenization, batching or JSON. With `--encoder DIR` (an encoder embedding model,
served through the `embeddings` extra) the server serves DIR and the plain forward is mlx-vlm's
model on the same padded rows with their attention mask, pooled as its config says. Rounds
alternate the two, so the noise of a shared machine falls on both; the figure is the median
round. The ratio is server / plain.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_kvserve.blas import preload_optimised_blas  # noqa: E402

preload_optimised_blas()  # before MLX is imported (Linux only; a no-op on macOS)

import httpx  # noqa: E402
import mlx.core as mx  # noqa: E402
from _bench_common import (  # noqa: E402
    Server,
    add_run_options,
    machine,
    model_dir,
    set_blas_threads,  # noqa: E402
    workdir,
)
from mlx_lm import load  # noqa: E402

WORDS = [
    "the",
    "sky",
    "river",
    "stone",
    "light",
    "quiet",
    "north",
    "paper",
    "window",
    "garden",
    "engine",
    "cloud",
]


def texts(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words)))
        for _ in range(count)
    ]


def plain_forward(model, rows: list[list[int]]) -> float:
    """Seconds for one padded forward of `rows` and mean pooling, evaluated."""
    width = max(len(r) for r in rows)
    started = time.perf_counter()
    padded = mx.array([r + [0] * (width - len(r)) for r in rows])
    hidden = model.model(padded).astype(mx.float32)
    lengths = mx.array([len(r) for r in rows])
    keep = (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.float32)[..., None]
    pooled = (hidden * keep).sum(axis=1) / lengths[:, None]
    mx.eval(pooled)
    return time.perf_counter() - started


def encoder_forward(model, rows: list[list[int]]) -> float:
    """Seconds for one padded, masked forward of `rows` through an mlx-vlm embedding model."""
    width = max(len(r) for r in rows)
    started = time.perf_counter()
    padded = mx.array([r + [0] * (width - len(r)) for r in rows])
    mask = (mx.arange(width)[None, :] < mx.array([len(r) for r in rows])[:, None]).astype(mx.int32)
    mx.eval(model(padded, attention_mask=mask).text_embeds)
    return time.perf_counter() - started


def through_server(client: httpx.Client, inputs: list[str]) -> float:
    started = time.perf_counter()
    reply = client.post("/v1/embeddings", json={"input": inputs, "encoding_format": "float"})
    reply.raise_for_status()
    assert len(reply.json()["data"]) == len(inputs)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--words", type=int, default=40, help="words per input, at most")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--encoder", type=Path, help="an encoder embedding model's directory")
    add_run_options(parser)
    args = parser.parse_args()
    set_blas_threads(args.blas_threads)
    batch = texts(args.inputs, args.words)
    if args.encoder is not None:
        from mlx_lm.utils import load_tokenizer

        from mlx_kvserve.embed.encoder import load_encoder
        from mlx_kvserve.embed.kind import pooling_config

        model, _ = load_encoder(args.encoder, pooling_config(args.encoder))
        tokenizer = load_tokenizer(args.encoder)
        forward, extra, label = encoder_forward, ["--model", str(args.encoder)], "plain mlx-vlm"
    else:
        model, tokenizer = load(str(model_dir()))
        forward, extra, label = plain_forward, [], "plain mlx-lm"
    rows = [tokenizer.encode(t) for t in batch]
    tokens = sum(len(r) for r in rows)
    forward(model, rows[:2])  # warm up
    with workdir(args.keep) as root:
        server = Server("kvserve", root, no_cache=True, extra=extra).start()
        try:
            with httpx.Client(base_url=server.base_url, timeout=600) as client:
                through_server(client, batch[:2])  # warm up
                plain: list[float] = []
                served: list[float] = []
                for _ in range(args.rounds):
                    plain.append(forward(model, rows))
                    served.append(through_server(client, batch))
        finally:
            server.stop()
    p, s = statistics.median(plain), statistics.median(served)
    print(f"machine: {machine()}")
    longest = max(map(len, rows))
    print(f"batch: {args.inputs} inputs, {tokens} tokens (longest {longest}), {args.rounds} rounds")
    print(f"{'':18}{'seconds':>10}{'embeddings/s':>15}{'tokens/s':>12}")
    print(f"{label:18}{p:10.3f}{args.inputs / p:15.1f}{tokens / p:12.0f}")
    print(f"{'server':18}{s:10.3f}{args.inputs / s:15.1f}{tokens / s:12.0f}")
    print(f"server / plain: {p / s:.2f}x")


if __name__ == "__main__":
    main()
