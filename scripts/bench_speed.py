#!/usr/bin/env python3
"""Prefill and decode speed of a model under mlx-lm, with and without the optimised BLAS.

    python scripts/bench_speed.py                 # default model, BLAS vs reference BLAS
    python scripts/bench_speed.py --model DIR     # any mlx-lm model directory or hub repo
    python scripts/bench_speed.py --no-blas       # only the reference-BLAS path

Prefill: one forward pass over an N-token prompt, in chunks of --chunk tokens, into a fresh
prompt cache (a warm-up run first, then the median of --repeats runs). Decode: greedy steps of one
token each after a 512-token prompt. Unless --no-compare, the reference-BLAS numbers are measured
in a child process (MLX_KVSERVE_BLAS=off, BLAS must be chosen before MLX is imported) with fewer
and shorter runs, because that path is about 30x slower.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or hub repo (default: built-in)")
    p.add_argument(
        "--variant",
        choices=["auto", "f32", "q4_1"],
        default="auto",
        help="built-in model variant (auto: q4_1 on macOS, f32 elsewhere)",
    )
    p.add_argument("--lengths", default="512,2048", help="prompt lengths to prefill")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per length (median)")
    p.add_argument("--decode-steps", type=int, default=128, help="greedy decode steps")
    p.add_argument("--no-blas", action="store_true", help="use MLX's bundled reference BLAS")
    p.add_argument("--no-compare", action="store_true", help="skip the reference-BLAS child run")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child -> parent
    return p.parse_args(argv)


def _prefill(model, tokens, chunk: int) -> float:
    """Seconds for one chunked forward pass over ``tokens`` into a fresh cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    start = time.perf_counter()
    for i in range(0, tokens.shape[0], chunk):
        logits = model(tokens[i : i + chunk][None], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    return time.perf_counter() - start


def _decode(model, prompt, steps: int) -> float:
    """Greedy decode tokens/s after prefilling ``prompt``, one token per forward pass."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
    return steps / (time.perf_counter() - start)


def measure(args: argparse.Namespace) -> dict:
    """Run the benchmark in this process; returns the numbers as a dict."""
    if args.no_blas:
        os.environ["MLX_KVSERVE_BLAS"] = "off"
    from mlx_kvserve.blas import preload_optimised_blas

    blas = preload_optimised_blas()  # before anything imports mlx
    from mlx_kvserve.models.resolve import local_model_dir, resolve_model
    from mlx_kvserve.paths import data_dir

    if args.model is None and args.variant != "auto":
        from mlx_kvserve.models import DEFAULT_MODEL_ID, ensure_default_model

        model_id = DEFAULT_MODEL_ID
        quantized = args.variant == "q4_1"
        ref = str(ensure_default_model(data_dir(), progress=not args.json, quantized=quantized))
    else:
        model_id, ref = resolve_model(args.model, data_dir(), progress=not args.json)

    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(local_model_dir(ref)))
    vocab = int(getattr(tokenizer, "vocab_size", 32000))
    lengths = [int(n) for n in args.lengths.split(",") if n]
    mx.random.seed(0)
    # Ordinary (non-special) token ids; their content does not affect speed.
    tokens = mx.random.randint(100, vocab - 100, (max(lengths + [512]),))
    result: dict = {
        "model": model_id,
        "blas": blas or "reference (mlx-cpu bundled)",
        "device": str(mx.default_device()),
        "prefill": {},
    }
    for n in lengths:
        _prefill(model, tokens[:n], args.chunk)  # warm-up
        times = [_prefill(model, tokens[:n], args.chunk) for _ in range(args.repeats)]
        result["prefill"][str(n)] = n / statistics.median(times)
    _decode(model, tokens[:16], 4)  # warm-up
    result["decode"] = _decode(model, tokens[:512], args.decode_steps)
    result["decode_steps"] = args.decode_steps
    return result


def _print(result: dict, label: str) -> None:
    print(f"{label}: {result['model']} on {result['device']}, BLAS: {result['blas']}")
    for n, tps in result["prefill"].items():
        print(f"  prefill {int(n):>5} tokens: {tps:8.1f} tokens/s")
    print(f"  decode ({result['decode_steps']} greedy steps): {result['decode']:8.1f} tokens/s")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    _print(result, "reference BLAS" if args.no_blas else "optimised BLAS")
    if args.no_blas or args.no_compare or not sys.platform.startswith("linux"):
        return 0

    print("measuring the reference-BLAS path in a child process (slow)...", flush=True)
    child = [sys.executable, str(Path(__file__).resolve()), "--json", "--no-blas"]
    child += ["--variant", args.variant, "--lengths", "512", "--repeats", "1"]
    child += ["--decode-steps", "16"]
    if args.model:
        child += ["--model", args.model]
    env = {**os.environ, "MLX_KVSERVE_BLAS": "off"}
    proc = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"child run failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return 1
    naive = json.loads(proc.stdout.strip().splitlines()[-1])
    _print(naive, "reference BLAS")
    fast = result["prefill"].get("512")
    slow = naive["prefill"].get("512")
    if fast and slow:
        print(f"  -> prefill speed-up at 512 tokens: {fast / slow:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
