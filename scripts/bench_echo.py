#!/usr/bin/env python3
"""Prompt scoring (echo with logprobs, as lm-evaluation-harness asks) through the server against
a plain mlx-lm forward of the same batch.

    python scripts/bench_echo.py                  # default model, 32 prompts, 5 rounds
    python scripts/bench_echo.py --prompts 64 --words 80 --rounds 3

The server (`mlx-kvserve serve`, default model, prompt cache off) answers `/v1/completions` with
the prompts as token ids, `echo: true`, `logprobs: 1`, `max_tokens: 0`: each prompt token's log
probability and its most likely alternative, in JSON. This process loads the same model
directory with `mlx_lm.load` and runs the same token rows, padded on the right into one array,
through the model, then the log-softmax, each next token's log probability and the best
alternative, evaluated: what the server computes, without HTTP, tokenization, batching, chunking
or JSON. Rounds alternate the two, so the noise of a shared machine falls on both; the figure is
the median round. The ratio is server / plain in tokens per second.
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
    set_blas_threads,
    workdir,
)
from mlx_lm import load  # noqa: E402

from mlx_kvserve.vocabulary import vocabulary_size  # noqa: E402

WORDS = ["the", "sky", "river", "stone", "light", "quiet", "north", "paper", "window", "garden"]


def prompts(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words)))
        for _ in range(count)
    ]


def plain_forward(model, rows: list[list[int]], vocab: int) -> float:
    """Seconds for one padded forward of `rows` and each next token's log probability and best
    alternative, evaluated."""
    width = max(len(r) for r in rows)
    started = time.perf_counter()
    padded = mx.array([r + [0] * (width - len(r)) for r in rows])
    logits = model(padded[:, :-1])[..., :vocab].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, padded[:, 1:, None], axis=-1)
    best = mx.argmax(logprobs, axis=-1)
    mx.eval(chosen, best, mx.max(logprobs, axis=-1))
    return time.perf_counter() - started


def through_server(client: httpx.Client, rows: list[list[int]]) -> float:
    started = time.perf_counter()
    reply = client.post(
        "/v1/completions",
        json={"prompt": rows, "echo": True, "logprobs": 1, "max_tokens": 0},
    )
    reply.raise_for_status()
    choices = reply.json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [len(r) for r in rows]
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--words", type=int, default=60, help="words per prompt, at most")
    parser.add_argument("--rounds", type=int, default=5)
    add_run_options(parser)
    args = parser.parse_args()
    set_blas_threads(args.blas_threads)
    model, tokenizer = load(str(model_dir()))
    rows = [tokenizer.encode(t) for t in prompts(args.prompts, args.words)]
    vocab = vocabulary_size(tokenizer) or len(tokenizer.vocab)
    tokens = sum(len(r) for r in rows)
    plain_forward(model, rows[:2], vocab)  # warm up
    with workdir(args.keep) as root:
        server = Server("kvserve", root, no_cache=True).start()
        try:
            with httpx.Client(base_url=server.base_url, timeout=600) as client:
                through_server(client, rows[:2])  # warm up
                plain: list[float] = []
                served: list[float] = []
                for _ in range(args.rounds):
                    plain.append(plain_forward(model, rows, vocab))
                    served.append(through_server(client, rows))
        finally:
            server.stop()
    p, s = statistics.median(plain), statistics.median(served)
    print(f"machine: {machine()}")
    longest = max(map(len, rows))
    print(
        f"batch: {args.prompts} prompts, {tokens} tokens (longest {longest}), {args.rounds} rounds"
    )
    print(f"{'':18}{'seconds':>10}{'prompts/s':>12}{'tokens/s':>12}")
    print(f"{'plain mlx-lm':18}{p:10.3f}{args.prompts / p:12.1f}{tokens / p:12.0f}")
    print(f"{'server':18}{s:10.3f}{args.prompts / s:12.1f}{tokens / s:12.0f}")
    print(f"server / plain: {p / s:.2f}x")


if __name__ == "__main__":
    main()
