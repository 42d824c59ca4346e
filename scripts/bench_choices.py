#!/usr/bin/env python3
"""Several choices of one prompt: `n=4` in one request against four separate requests.

    python scripts/bench_choices.py                      # default model, 4 choices
    python scripts/bench_choices.py --n 4 --prompt-tokens 500 --tokens 64 --rounds 3

One real server of the default model (prompt cache on, as shipped). Each round asks a prompt no
earlier round sent (a fresh system prefix, so every mode starts cold) for `--n` answers at
temperature 0.8, seeded, each running to `--tokens` (`ignore_eos`), three ways:
- one request with `n` (one prefill, its KV copied into a row per choice);
- `n` separate requests sent at once (each prefills the prompt; they decode in one batch);
- `n` separate requests one after another (the first prefills, the others find its prompt in
  the prompt cache, but nothing decodes side by side).
The figure is the wall time from the first request to the last answer (median over rounds), and
the speed-up of the one request over each other way. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts._bench_common import machine  # noqa: E402
from tests.support.servers import ServerProcess  # noqa: E402

FILLER = (
    "The shop repairs bicycles, sells parts and rents city bikes by the day. Opening hours are "
    "nine to six on weekdays and ten to four on Saturdays. "
)


def prompt(words: int) -> list[dict]:
    """A fresh conversation of about `words` tokens (the default model: ~1 token per word)."""
    system = f"Session {uuid.uuid4().hex}. " + FILLER * max(1, words // 30)
    ask = "Write a short advertisement for the shop."
    return [{"role": "system", "content": system}, {"role": "user", "content": ask}]


def post(base_url: str, body: dict, out: list[dict]) -> None:
    with httpx.Client(base_url=base_url, timeout=1800) as http:
        reply = http.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        out.append(reply.json())


def run(base_url: str, mode: str, n: int, words: int, tokens: int) -> tuple[float, int]:
    """(seconds, completion tokens) of `n` answers to one fresh prompt, asked as `mode`."""
    messages = prompt(words)
    body = {
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0.8,
        "seed": 1,
        "ignore_eos": True,
    }
    replies: list[dict] = []
    started = time.perf_counter()
    if mode == "n":
        post(base_url, {**body, "n": n}, replies)
    elif mode == "together":
        threads = [
            threading.Thread(target=post, args=(base_url, {**body, "seed": 1 + i}, replies))
            for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(n):
            post(base_url, {**body, "seed": 1 + i}, replies)
    seconds = time.perf_counter() - started
    completion = sum(r["usage"]["completion_tokens"] for r in replies)
    if completion != n * tokens:
        raise SystemExit(f"{mode}: {completion} completion tokens, expected {n * tokens}")
    return seconds, replies[0]["usage"]["prompt_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=500, help="about this many")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of every answer")
    ap.add_argument("--rounds", type=int, default=3, help="medians over this many rounds")
    args = ap.parse_args()
    modes = {"n": f"one request, n={args.n}", "together": f"{args.n} requests at once"}
    modes["sequential"] = f"{args.n} requests one after another"
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(tmp), "--max-concurrency", str(args.n)).wait_ready()
        try:
            run(server.base_url, "n", 2, 50, 4)  # warm-up
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            prompt_tokens = 0
            for _ in range(args.rounds):
                for mode in modes:
                    seconds, prompt_tokens = run(
                        server.base_url, mode, args.n, args.prompt_tokens, args.tokens
                    )
                    times[mode].append(seconds)
        except BaseException:
            print(server.log()[-3000:], file=sys.stderr)  # why: the server's own words
            raise
        finally:
            server.stop()
    print(machine())
    print(
        f"default model, prompt {prompt_tokens} tokens, {args.n} answers of {args.tokens} "
        f"tokens, temperature 0.8, median of {args.rounds} rounds"
    )
    best = statistics.median(times["n"])
    print("| how | seconds | one request with n is |")
    print("|---|---:|---:|")
    for mode, label in modes.items():
        seconds = statistics.median(times[mode])
        print(f"| {label} | {seconds:.1f} | {seconds / best:.2f}x faster |")


if __name__ == "__main__":
    main()
