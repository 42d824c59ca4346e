#!/usr/bin/env python3
"""N agents at once against the same N one after another, per cache architecture.

    python scripts/bench_batching.py                   # 4 agents, hybrid, window and plain
    python scripts/bench_batching.py --agents 4 --tokens 96 --archs qwen3_5 gemma3-270m

Each architecture is served by a real server (`--no-cache`, so both runs prefill the same cold
prompts; `--max-concurrency` = the number of agents): `llama` (plain KV), `qwen3_5` (hybrid:
linear-attention layers with a fixed-size state, `ArraysCache`, and full-attention layers) and
`gemma3_text` (sliding-window layers, `RotatingKVCache`) as random-weight models of mlx-lm's own
classes, sized so that a forward pass is matrix work rather than interpreter overhead (hidden
512, 8 layers, about 40M parameters without the embedding), and `gemma3-270m`, the embedded real
Gemma 3 270M (window 512). Every agent asks its own question
(about 150 prompt tokens), greedy, `max_tokens` fixed; the figure is completion tokens of all
agents over the wall time from the first request to the last answer. Prints the two rates and
their ratio side by side; nothing asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.servers import ServerProcess  # noqa: E402
from tests.support.tiny_models import make_model_dir  # noqa: E402

SIZE = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
OVERRIDES = {
    "llama": SIZE,
    "qwen3_5": {
        **SIZE,
        "linear_num_value_heads": 8,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
    },
    "gemma3_text": {**SIZE, "num_key_value_heads": 1, "query_pre_attn_scalar": 64},
}
TOPICS = ["brakes", "tyres", "lights", "chains", "saddles", "pedals", "racks", "bells"]


def question(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    system = "You are the help desk of a bicycle shop. Answer in detail, step by step. " * 6
    ask = f"Agent {i}: explain how to choose, fit and maintain {topic}, with prices."
    return [{"role": "system", "content": system}, {"role": "user", "content": ask}]


def ask(base_url: str, i: int, tokens: int, out: list[int]) -> None:
    body = {"model": "m", "messages": question(i), "max_tokens": tokens, "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=900) as http:
        reply = http.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        out.append(reply.json()["usage"]["completion_tokens"])


def run(base_url: str, agents: int, tokens: int, together: bool) -> float:
    """Completion tokens per second of `agents` agents, together or one after another."""
    done: list[int] = []
    started = time.perf_counter()
    if together:
        threads = [
            threading.Thread(target=ask, args=(base_url, i, tokens, done)) for i in range(agents)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(agents):
            ask(base_url, i, tokens, done)
    if len(done) != agents:
        raise SystemExit("a request failed")
    return sum(done) / (time.perf_counter() - started)


def model_arg(arch: str, work: Path) -> str:
    """What `--model` names: the embedded model's id, or a built model's directory."""
    if arch == "gemma3-270m":
        return arch  # converted once, like the default (the first run fetches and converts it)
    return str(make_model_dir(work / arch, arch, **OVERRIDES[arch]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--archs", nargs="+", default=["llama", "qwen3_5", "gemma3_text", "gemma3-270m"]
    )
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96, help="max_tokens of every answer")
    ap.add_argument("--rounds", type=int, default=2, help="medians over this many rounds")
    args = ap.parse_args()
    print(f"{args.agents} agents, {args.tokens} tokens each, greedy, --no-cache")
    print(f"| model | one after another (tok/s) | {args.agents} at once (tok/s) | ratio |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for arch in args.archs:
            (work / f"srv-{arch}").mkdir()
            server = ServerProcess(
                work / f"srv-{arch}",
                "--model",
                model_arg(arch, work),
                "--no-cache",
                "--max-concurrency",
                str(args.agents),
            )
            try:
                server.wait_ready()
                run(server.base_url, 1, 8, together=False)  # warm-up
                alone, together = [], []
                for _ in range(args.rounds):
                    alone.append(run(server.base_url, args.agents, args.tokens, together=False))
                    together.append(run(server.base_url, args.agents, args.tokens, together=True))
            finally:
                server.stop()
            a, t = statistics.median(alone), statistics.median(together)
            print(f"| {arch} | {a:.1f} | {t:.1f} | {t / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
