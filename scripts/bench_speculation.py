#!/usr/bin/env python3
"""Decode speed with and without speculative decoding, side by side (docs/speculation.md).

    python scripts/bench_speculation.py              # default model, 5 runs per cell
    python scripts/bench_speculation.py --reps 9 --blas-threads 2

Two servers of the default model in one run, `--speculation off` and `auto`, each asked the
same greedy requests one at a time: a text completion that copies a file it was shown (an agent
re-emitting code), a forced tool call (`tool_choice` "required": a grammar row, its forced
tokens and its drafted arguments), and prose. Each cell is the median over --reps of the
servers' own decode tokens/s (their log line: completion tokens after the first over decode
time, so prefill and HTTP are left out), with what the `auto` server drafted and kept; the
texts of the two servers are compared (greedy: they must be equal).

This first version covers one request at a time on short contexts; issue 31's full table
(concurrent agents, 2k and 16k contexts, `mlx_lm.server` beside) is still to come.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from _bench_common import (  # noqa: E402
    Server,
    add_run_options,
    load_average,
    machine,
    set_blas_threads,
    workdir,
)

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CELLS = {
    "copy a file (text)": (
        "/v1/completions",
        {"prompt": f"Here is a file:\n\n{CODE}\nThe same file again, unchanged:\n\n"},
    ),
    "tool call (required)": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Weather in Paris and Lyon? Use the tool."}],
            "tools": [WEATHER],
            "tool_choice": "required",
        },
    ),
    "prose (chat)": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Tell a story about a lighthouse keeper."}]},
    ),
}
LINE = re.compile(r"decode=([\d.]+) tok/s.*?(?:drafted=(\d+) accepted=(\d+) passes=(\d+))?$")


def ask(server: Server, route: str, body: dict, max_tokens: int) -> tuple[str, dict]:
    """One greedy request; its text (or calls) and the server's log figures for it."""
    body = {"model": "default", "temperature": 0, "max_tokens": max_tokens, **body}
    reply = httpx.post(server.base_url + route, json=body, timeout=900).json()
    choice = reply["choices"][0]
    message = choice.get("message") or {}
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    text = choice.get("text") or f"{message.get('content')} {calls}"  # not the calls' random ids
    figures: dict = {}
    while not figures:
        for line in server.new_log_lines():
            if (m := LINE.search(line)) is not None:
                drafted, accepted, passes = (int(x or 0) for x in m.groups()[1:])
                figures = {"tps": float(m[1]), "drafted": drafted, "accepted": accepted}
                figures["passes"] = passes
    return text, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=80)
    add_run_options(parser)
    args = parser.parse_args()
    set_blas_threads(args.blas_threads)
    with workdir(args.keep) as tmp:
        servers = {
            mode: Server("kvserve", tmp, cache_dir=tmp / mode, extra=["--speculation", mode])
            for mode in ("off", "auto")
        }
        for server in servers.values():
            server.start()
        print(f"# {machine()}; load average before: {load_average()}")
        print(f"# median decode tok/s of {args.reps} greedy runs, {args.max_tokens} tokens at most")
        print(f"{'cell':24s} {'off':>8s} {'auto':>8s} {'ratio':>6s}  drafted/kept/passes  same")
        for name, (route, body) in CELLS.items():
            speeds: dict[str, list[float]] = {"off": [], "auto": []}
            texts: dict[str, set[str]] = {"off": set(), "auto": set()}
            spec = [0, 0, 0]
            for _ in range(args.reps):
                for mode, server in servers.items():
                    text, figures = ask(server, route, body, args.max_tokens)
                    speeds[mode].append(figures["tps"])
                    texts[mode].add(text)
                    if mode == "auto":
                        for i, key in enumerate(("drafted", "accepted", "passes")):
                            spec[i] += figures[key]
            off, auto = (statistics.median(speeds[m]) for m in ("off", "auto"))
            same = "yes" if texts["off"] == texts["auto"] and len(texts["off"]) == 1 else "NO"
            print(
                f"{name:24s} {off:8.1f} {auto:8.1f} {auto / off:5.2f}x  "
                f"{spec[0]:>7d}/{spec[1]}/{spec[2]:<9d} {same}",
                flush=True,
            )
        print(f"# load average after: {load_average()}")


if __name__ == "__main__":
    main()
