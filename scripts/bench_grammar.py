#!/usr/bin/env python3
"""The cost of constrained decoding: decode tokens/s with and without a grammar, in one run.

    python scripts/bench_grammar.py              # default model, 5 rounds
    python scripts/bench_grammar.py --rounds 10
    python scripts/bench_grammar.py --formats-only   # just the per-format table

One mlx-kvserve server; each round sends every mode once (interleaved, so drift hits all modes
alike), streaming through the openai SDK. Decode speed is (completion tokens - 1) / (time of the
last chunk - time of the first), the median over rounds. Modes:

* free       : plain text, no grammar (the baseline);
* lazy-auto  : the same prompt with a tool offered in `tool_choice: auto`, so a lazy grammar
               computes a token mask every step but the model writes text (pure mask cost);
* json       : `response_format` json_schema (every token masked by a JSON grammar);
* tool-forced: `tool_choice: required` (the whole answer is a grammar-constrained call).

Then a column per tool-call format (scripts/_bench_formats.py): each format the server constrains
(its registry), on a tiny random-weight model with a real chat template in that format, decode
tokens/s as the engine logged it with `tool_choice` none (no grammar), auto (a lazy grammar) and
required (the format's call grammar).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Server, machine, workdir  # noqa: E402
from _bench_formats import run as run_formats  # noqa: E402

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "notes": {"type": "string", "maxLength": 200},
            },
            "required": ["city", "unit", "days", "notes"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "summary": {"type": "string", "maxLength": 300},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
    },
    "required": ["title", "summary", "tags"],
}
PROMPT = "Write a short story about a lighthouse keeper and a storm."


def modes() -> dict[str, dict]:
    user = [{"role": "user", "content": PROMPT}]
    return {
        "free": {"messages": user},
        "lazy-auto": {"messages": user, "tools": [TOOL], "tool_choice": "auto"},
        "json": {
            "messages": user,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            },
        },
        "tool-forced": {"messages": user, "tools": [TOOL], "tool_choice": "required"},
    }


def measure(client, kwargs: dict, max_tokens: int) -> tuple[float, int]:
    first = last = None
    tokens = 0
    stream = client.chat.completions.create(
        model="bench",
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **kwargs,
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        elif chunk.choices and (
            chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls
        ):
            first = first or now
            last = now
    if first is None or last is None or tokens < 3 or last <= first:
        return 0.0, tokens
    return (tokens - 1) / (last - first), tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--formats-only", action="store_true", help="only the per-format table")
    args = p.parse_args(argv)
    print(f"machine: {machine()}")
    print(f"rounds: {args.rounds}, max_tokens {args.max_tokens}, temperature 0\n")
    if not args.formats_only:
        default_model(args)
    with workdir(args.keep) as work:
        print("\nPer tool-call format (tiny random-weight models, real templates):\n")
        print("\n".join(run_formats(work, [TOOL], args.rounds, args.max_tokens)))
    return 0


def default_model(args: argparse.Namespace) -> None:
    """The modes above on the default model (the Hermes fallback format)."""
    import openai

    with workdir(args.keep) as work:
        server = Server("kvserve", work, cache_dir=work / "cache").start()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        rates: dict[str, list[float]] = {name: [] for name in modes()}
        counts: dict[str, list[int]] = {name: [] for name in modes()}
        for kwargs in modes().values():  # warm-up: grammar compile, tokenizer twin
            measure(client, kwargs, 8)
        for _ in range(args.rounds):
            for name, kwargs in modes().items():
                rate, n = measure(client, kwargs, args.max_tokens)
                rates[name].append(rate)
                counts[name].append(n)
        server.stop()
    base = statistics.median(rates["free"])
    print("| mode | decode tok/s (median) | vs free | tokens per answer (median) |")
    print("| --- | --- | --- | --- |")
    for name in modes():
        rate = statistics.median(rates[name])
        n = statistics.median(counts[name])
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {n:.0f} |")


if __name__ == "__main__":
    raise SystemExit(main())
