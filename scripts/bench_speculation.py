#!/usr/bin/env python3
"""Decode speed with and without speculative decoding, side by side (docs/speculation.md).

    python scripts/bench_speculation.py              # default model, 5 runs per cell
    python scripts/bench_speculation.py --reps 9 --blas-threads 2

Two servers of the default model in one run, `--speculation off` and `auto`, each asked the
same greedy requests one at a time: a text completion that copies a file it was shown and one
that writes it again with a change (an agent re-emitting code), a forced tool call
(`tool_choice` "required": a grammar row, its forced tokens and its drafted arguments), a
replayed tool loop (the turns of a recorded agent loop, reading and editing a file, asked again
as a new conversation: the paths and JSON arguments the first pass wrote come back, drafted
from the prompt cache's continuations), and prose. Every repetition of the other cells asks
something new (another file, city, topic), so none replays an earlier request. Each cell is the
median over its requests of the servers' own decode tokens/s (their log line: completion
tokens after the first over decode time, so prefill and HTTP are left out), with what the
`auto` server drafted and kept (and kept from the prompt cache's continuations, from its
/metrics); the texts of the two servers are compared (greedy: they must be equal).

This version covers one request at a time on short contexts; issue 31's full table
(concurrent agents, 2k and 16k contexts, `mlx_lm.server` beside) is still to come.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
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

CODE = '''def {name}(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
NAMES = ["area", "surface", "size", "extent", "footprint", "measure", "span", "room", "space"]
CITIES = ["Paris", "Lyon", "Rome", "Oslo", "Lima", "Cairo", "Quito", "Perth", "Dakar", "Riga"]
TOPICS = ["a lighthouse keeper", "a baker", "a lost cat", "a river", "a clockmaker", "a comet"]
TOPICS += ["a gardener", "an old bridge", "a violin"]


def tool(name: str, description: str, **properties: str) -> dict:
    params = {
        "type": "object",
        "properties": {k: {"type": "string", "description": v} for k, v in properties.items()},
        "required": list(properties),
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": params},
    }


WEATHER = tool("get_weather", "The weather in a city.", city="the city")
READ = tool("read_file", "Read a file of the repository.", path="the file's path")
EDIT = tool("edit_file", "Replace text in a file.", path="the file's path", old="text", new="text")
# A recorded agent loop (hand-written history: the calls an agent made and what the tools said):
# each turn asks the model for its next call. The replay is a new conversation asking the same.
LOOP_FILE = "src/geometry/shapes.py"
LOOP = [
    {"role": "system", "content": "You are a coding agent. Use the tools."},
    {"role": "user", "content": f"Rename the function area to rect_area in {LOOP_FILE}."},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "read_file", "arguments": f'{{"path": "{LOOP_FILE}"}}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": CODE.format(name="area")},
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "c2",
                "type": "function",
                "function": {
                    "name": "edit_file",
                    "arguments": json.dumps(
                        {"path": LOOP_FILE, "old": "def area(", "new": "def rect_area("}
                    ),
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": f"Edited {LOOP_FILE}: 1 replacement."},
]
LOOP += [{"role": "user", "content": "Now write the commit message for this change."}]
# The histories each replayed turn is asked with, and its tool_choice: the agent's two calls,
# then its commit message (prose of its own, in no prompt: only the first pass wrote it).
LOOP_TURNS = [(2, "required"), (4, "required"), (7, "none")]


def cells(rep: int) -> dict[str, list[tuple[str, dict]]]:
    """Each cell's timed requests for repetition `rep`: new requests every time (another file,
    city, topic), so no request replays an earlier one, but the replayed tool loop, which does
    by design (its first pass, untimed, is `warm_up`'s)."""
    code = CODE.format(name=NAMES[rep % len(NAMES)])
    a, b = CITIES[rep % len(CITIES)], CITIES[(rep + 1) % len(CITIES)]
    return {
        "copy a file (text)": [
            (
                "/v1/completions",
                {"prompt": f"Here is a file:\n\n{code}\nThe same file again, unchanged:\n\n"},
            )
        ],
        "edit a file (text)": [
            (
                "/v1/completions",
                {
                    "prompt": f"Here is a file:\n\n{code}\nThe same file with its docstrings"
                    " in upper case:\n\n"
                },
            )
        ],
        "tool call (required)": [
            (
                "/v1/chat/completions",
                {
                    "messages": [
                        {"role": "user", "content": f"Weather in {a} and {b}? Use the tool."}
                    ],
                    "tools": [WEATHER],
                    "tool_choice": "required",
                },
            )
        ],
        "replayed tool loop (chat)": warm_up(),
        "prose (chat)": [
            (
                "/v1/chat/completions",
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": f"Tell a story about {TOPICS[rep % len(TOPICS)]}.",
                        }
                    ]
                },
            )
        ],
    }


def warm_up() -> list[tuple[str, dict]]:
    """The agent loop's turns (asked once before the timed runs: the loop's first pass)."""
    return [
        (
            "/v1/chat/completions",
            {"messages": LOOP[:turn], "tools": [READ, EDIT], "tool_choice": choice},
        )
        for turn, choice in LOOP_TURNS
    ]


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


def streamed_tps(server: Server, route: str, body: dict, max_tokens: int) -> float:
    """Decode tokens/s seen by a client of any server: a streamed greedy request's completion
    tokens after the first over the time from its first text to its last (prefill left out)."""
    body = {"model": server.model_name, "temperature": 0, "max_tokens": max_tokens, **body}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    with httpx.stream("POST", server.base_url + route, json=body, timeout=900) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if choice.get("text") or delta.get("content"):
                    last = time.perf_counter()
                    first = first or last
    return (tokens - 1) / (last - first) if first and last and last > first else float("nan")


def cache_kept(server: Server) -> float:
    """Drafted tokens from the prompt cache's continuations the server kept so far."""
    text = httpx.get(server.base_url + "/metrics", timeout=60).text
    pattern = r'^mlx_kvserve_speculation_accepted_tokens_total\{source="prompt_cache"\} (\S+)$'
    return float(re.findall(pattern, text, re.M)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="at most 4 with --mlx-lm")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument(
        "--mlx-lm",
        action="store_true",
        help="also time mlx_lm.server from the client, beside both servers, on the cells it "
        "serves (no forced tool choice): a second table",
    )
    add_run_options(parser)
    args = parser.parse_args()
    set_blas_threads(args.blas_threads)
    with workdir(args.keep) as tmp:
        for mode in ("off", "auto", "mlx_lm"):
            (tmp / mode).mkdir()  # a log of its own each
        servers = {
            mode: Server(
                "kvserve", tmp / mode, cache_dir=tmp / mode / "cache", extra=["--speculation", mode]
            )
            for mode in ("off", "auto")
        }
        for server in servers.values():
            server.start()
        print(f"# {machine()}; load average before: {load_average()}")
        print(f"# median decode tok/s of {args.reps} greedy runs, {args.max_tokens} tokens at most")
        for server in servers.values():  # the recorded loop's first pass, untimed
            for route, body in warm_up():
                ask(server, route, body, args.max_tokens)
        head = f"{'cell':26s} {'off':>6s} {'auto':>6s} {'ratio':>6s}"
        print(f"{head}  drafted/kept/passes  kept from the cache  same")
        names = list(cells(0))
        for name in names:
            speeds: dict[str, list[float]] = {"off": [], "auto": []}
            texts: dict[str, list[str]] = {"off": [], "auto": []}
            spec = [0, 0, 0]
            from_cache = cache_kept(servers["auto"])
            for rep in range(args.reps):
                for route, body in cells(rep)[name]:
                    for mode, server in servers.items():
                        text, figures = ask(server, route, body, args.max_tokens)
                        speeds[mode].append(figures["tps"])
                        texts[mode].append(text)
                        if mode == "auto":
                            for i, key in enumerate(("drafted", "accepted", "passes")):
                                spec[i] += figures[key]
            from_cache = cache_kept(servers["auto"]) - from_cache
            off, auto = (statistics.median(speeds[m]) for m in ("off", "auto"))
            same = "yes" if texts["off"] == texts["auto"] else "NO"
            print(
                f"{name:26s} {off:6.1f} {auto:6.1f} {auto / off:5.2f}x  "
                f"{spec[0]:>7d}/{spec[1]}/{spec[2]:<9d} {from_cache:>19.0f}  {same}",
                flush=True,
            )
        if args.mlx_lm:
            servers["mlx_lm"] = Server("mlx_lm", tmp / "mlx_lm").start()
            compare(servers, args.reps, args.max_tokens)
        print(f"# load average after: {load_average()}")


def compare(servers: dict[str, Server], reps: int, max_tokens: int) -> None:
    """Client-timed decode tokens/s of every server, streamed, on the cells mlx_lm.server can
    serve (it has no forced tool choice): the median over the cell's requests."""
    print(f"# streamed, timed by the client: median decode tok/s of {reps} runs")
    print(f"{'cell':26s} {'off':>6s} {'auto':>6s} {'mlx_lm':>7s}  auto/mlx_lm")
    for name in cells(0):
        # requests the first table did not ask (repetitions reps.. of each cell), but the
        # replayed loop's, which replays by design
        requests = [req for rep in range(reps, 2 * reps) for req in cells(rep)[name]]
        if any(body.get("tool_choice") == "required" for _, body in requests):
            continue
        speeds = {mode: [] for mode in servers}
        for route, body in requests:
            for mode, server in servers.items():
                speeds[mode].append(streamed_tps(server, route, body, max_tokens))
                if mode != "mlx_lm":
                    server.new_log_lines()  # read past its line
        off, auto, ref = (statistics.median(speeds[m]) for m in ("off", "auto", "mlx_lm"))
        print(f"{name:26s} {off:6.1f} {auto:6.1f} {ref:7.1f}  {auto / ref:10.2f}x", flush=True)


if __name__ == "__main__":
    main()
