#!/usr/bin/env python3
"""Per-token cost of splitting a model across ranks: 1 rank against 2 (or more) on loopback.

    python scripts/bench_cluster.py                    # 1 vs 2 ranks, 64 decoded tokens
    python scripts/bench_cluster.py --ranks 1 2 --tokens 128 --hidden 1024

A random-weight llama of mlx-lm's own class (`--hidden`, 8 layers, 8 heads of hidden/8, 4 KV
heads, MLP 3x hidden) is written once; each job is `mlx.launch -n R --backend ring` running
this script's `--job` on every rank: the ranks join as the server's ranks will (`cluster join`:
same fingerprint, their shard, a greedy probe in lockstep), then decode `--tokens` greedy
tokens together, a step at a time, and rank 0 reports the median time per token. The job also
times a bare all-reduce of one token's hidden state (the message tensor parallelism sends twice
per layer) so the per-token collective cost is printed beside the step it is part of. Loopback
TCP on one machine says what the collectives cost in software, not what a Thunderbolt link
does (see docs/distributed.md for that arithmetic). Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def job(model_dir: Path, tokens: int) -> None:
    """One rank of the job (run by mlx.launch)."""
    from mlx_kvserve.blas import preload_optimised_blas

    preload_optimised_blas()  # before MLX is imported (Linux; one thread per rank here)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvserve.distributed.collective import Collective
    from mlx_kvserve.distributed.join import join_model

    collective = Collective.join(timeout=60)
    joined = join_model(collective, model_dir)
    model, tokenizer = joined.model, joined.tokenizer
    prompt = mx.array(tokenizer.encode("A bicycle shop in a river town " * 8))[None]
    steps = []
    for _ in range(2):  # a warm-up round, then the measured one
        caches = make_prompt_cache(model)
        started = time.perf_counter()
        logits = model(prompt, cache=caches)[:, -1, :]
        token = mx.argmax(logits, axis=-1, keepdims=True)
        mx.eval(token)
        prefill = time.perf_counter() - started
        steps = []
        for _ in range(tokens):
            started = time.perf_counter()
            token = mx.argmax(model(token, cache=caches)[:, -1, :], axis=-1, keepdims=True)
            mx.eval(token)
            steps.append(time.perf_counter() - started)
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    reduces = []
    if collective.distributed:
        x = mx.ones((1, 1, hidden), dtype=mx.float32)
        for _ in range(200):
            started = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=collective.group))
            reduces.append(time.perf_counter() - started)
    if collective.is_leader:
        layers = len(model.layers)
        print(
            json.dumps(
                {
                    "ranks": collective.size,
                    "mode": joined.plan.mode,
                    "prompt_tokens": int(prompt.shape[1]),
                    "prefill_s": prefill,
                    "step_s": statistics.median(steps),
                    "all_reduce_s": statistics.median(reduces) if reduces else 0.0,
                    "all_reduces_per_token": 2 * layers if collective.distributed else 0,
                }
            ),
            flush=True,
        )


def llama_size(hidden: int) -> dict[str, int]:
    """The benchmarks' llama: 8 layers, 8 heads of hidden/8, 4 KV heads, MLP 3x hidden."""
    return {
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": hidden // 8,
    }


def run(model_dir: Path, ranks: int, tokens: int) -> dict:
    from tests.support.launch import run_job  # free ports for every rank, retried binds

    cmd = [sys.executable, __file__, "--job", str(model_dir), "--tokens", str(tokens)]
    if ranks > 1:
        proc = run_job(cmd, ranks, timeout=1800)
    else:  # one rank is a plain process (mlx.launch's ring needs two)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if not rows:
        raise SystemExit(f"the {ranks}-rank job reported nothing:\n{proc.stderr[-3000:]}")
    return rows[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job is not None:
        job(args.job, args.tokens)
        return
    from tests.support.tiny_models import make_model_dir

    size = llama_size(args.hidden)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        model_dir = make_model_dir(Path(tmp) / "llama", "llama", **size)
        print(
            "| ranks | split | decode step | tokens/s | all-reduces a token | one all-reduce | "
            "all-reduces' share of a step | prefill |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        base = None
        for ranks in args.ranks:
            row = run(model_dir, ranks, args.tokens)
            step = row["step_s"]
            base = base or step
            share = row["all_reduce_s"] * row["all_reduces_per_token"] / step
            print(
                f"| {ranks} | {row['mode'] if ranks > 1 else '-'} | {step * 1e3:.2f} ms "
                f"({step / base:.2f}x) | {1 / step:.1f} | {row['all_reduces_per_token']} | "
                f"{row['all_reduce_s'] * 1e6:.0f} µs | {share:.0%} | "
                f"{row['prefill_s'] * 1e3:.0f} ms ({row['prompt_tokens']} tokens) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
