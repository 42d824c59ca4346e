#!/usr/bin/env python3
"""Decode speed with and without speculative decoding, and against mlx_lm.server, side by side.

    python scripts/bench_speculation.py                    # default model and Gemma 3 270M
    python scripts/bench_speculation.py --contexts 16384 --cells 16k --reps 1

Issue 31's table (docs/speculation.md): per model, three servers in one run, mlx-kvserve with
`--speculation off` and `auto` and `mlx_lm.server` (no speculation), each asked the same greedy
requests, interleaved (the order rotates each repetition, so a machine's changing load falls on
all three alike). The cells: (a) an agent's edit turn (a file written again with a change) and
a replayed tool loop (the turns of a recorded agent loop asked again as a new conversation: its
paths and JSON arguments come back, drafted from the prompt cache's continuations; mlx_lm.server
has no forced tool choice, so it sits this one out); (b) prose; (c) 1, 4 and 8 agents' edit
turns at once (throughput); (d) an edit after 2k and 16k tokens of repository files (capped at
the model's positions: SmolLM2 has 8k). Every repetition asks new requests but the replayed
loop's. Decode tokens/s are timed by the client from each round's first streamed text to its
last (prefill and HTTP before the first token left out), the median over the repetitions;
drafted/kept/passes are the `auto` server's (its log lines); "same" compares the off and auto
servers' texts (greedy: they must be equal).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
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

from mlx_kvserve.models.gemma3_model import GEMMA3_270M  # noqa: E402
from mlx_kvserve.paths import data_dir  # noqa: E402

CODE = '''def {name}(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
NAMES = ["area", "surface", "size", "extent", "footprint", "measure", "span", "room", "space"]
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


def prose(rep: int) -> tuple[str, dict]:
    """A story: nothing to copy (new every repetition)."""
    story = f"Tell a story about {TOPICS[rep % len(TOPICS)]}."
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": story}]}


def warm_up() -> list[tuple[str, dict]]:
    """The agent loop's turns (asked once before the timed runs: the loop's first pass)."""
    return [
        (
            "/v1/chat/completions",
            {"messages": LOOP[:turn], "tools": [READ, EDIT], "tool_choice": choice},
        )
        for turn, choice in LOOP_TURNS
    ]


LINE = re.compile(
    r"decode=([\d.]+) tok/s.*?(?:drafted=(\d+) accepted=(\d+) passes=(\d+))?"
    r"(?: by_source=(\S+))?$"
)


def ask(server: Server, route: str, body: dict, max_tokens: int) -> tuple[str, dict]:
    """One greedy request; its text (or calls) and the server's log figures for it."""
    body = {"model": "default", "temperature": 0, "max_tokens": max_tokens, **body}
    reply = httpx.post(server.base_url + route, json=body, timeout=900).json()
    if "choices" not in reply:  # a chat template that rejects the turn (Gemma 3: a tool turn)
        server.new_log_lines()
        return "", {}
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
                drafted, accepted, passes = (int(x or 0) for x in m.groups()[1:4])
                figures = {"tps": float(m[1]), "drafted": drafted, "accepted": accepted}
                figures["passes"] = passes
    return text, figures


def streamed(server: Server, route: str, body: dict, max_tokens: int) -> dict:
    """One streamed greedy request: its text, completion tokens, and the times of its first and
    last text (decode is timed by the client between them, so prefill is left out)."""
    model = "default" if server.kind == "kvserve" else server.model_name
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, **body}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens, parts = 0, []
    with httpx.stream("POST", server.base_url + route, json=body, timeout=1800) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for call in delta.get("tool_calls") or []:
                    function = call.get("function") or {}
                    parts.append(f"{function.get('name') or ''}{function.get('arguments') or ''}")
                    last = time.perf_counter()
                    first = first or last
                if text := choice.get("text") or delta.get("content"):
                    parts.append(text)
                    last = time.perf_counter()
                    first = first or last
    return {"text": "".join(parts), "tokens": tokens, "first": first, "last": last}


def round_tps(server: Server, requests: list[tuple[str, dict]], max_tokens: int) -> tuple:
    """The requests of one round at once (one each for the single-request cells): decode
    tokens/s over the round (tokens after each first over the time from the first text to the
    last), and the texts."""
    results: list[dict] = [{} for _ in requests]

    def one(i: int, route: str, body: dict) -> None:
        results[i] = streamed(server, route, body, max_tokens)

    threads = [
        threading.Thread(target=one, args=(i, route, body))
        for i, (route, body) in enumerate(requests)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(not r or r["first"] is None for r in results):
        return float("nan"), [r.get("text") for r in results]
    span = max(r["last"] for r in results) - min(r["first"] for r in results)
    tokens = sum(max(r["tokens"] - 1, 0) for r in results)
    return (tokens / span if span > 0 else float("nan")), [r["text"] for r in results]


def drafting(server: Server) -> tuple[list[int], list[int], list[str]]:
    """The [drafted, kept, passes] of the requests logged since the last call, their prompt
    tokens, and each one's drafted/kept/passes by source (the log line's `by_source`)."""
    spec, prompts, rows = [0, 0, 0], [], []
    for line in server.new_log_lines():
        if (m := LINE.search(line)) is not None:
            for i, x in enumerate(m.groups()[1:4]):
                spec[i] += int(x or 0)
            rows.append(m[5] or "-")
            if (p := re.search(r"prompt_tokens=(\d+)", line)) is not None:
                prompts.append(int(p[1]))
    return spec, prompts, rows


def repository(tokens: int) -> tuple[str, list[str]]:
    """About `tokens` tokens of a repository's files shown to an agent (each file's functions
    named apart), and the files' function names."""
    files, names, size, i = [], [], 0, 0
    while size < tokens * 3.3:  # about 3.3 characters per token of code for these tokenizers
        name = f"{NAMES[i % len(NAMES)]}_{i}"
        files.append(f"# file src/shapes_{i}.py\n{CODE.format(name=name)}")
        names.append(name)
        size += len(files[-1])
        i += 1
    return "\n".join(files), names


def edit(rep: int, context: str = "", name: str | None = None) -> tuple[str, dict]:
    """An agent's edit turn: a file written again with its docstrings in upper case."""
    code = CODE.format(name=name or NAMES[rep % len(NAMES)] + f"_{rep}")
    prompt = f"{context}\nHere is a file:\n\n{code}\nThe same file with its docstrings"
    return "/v1/completions", {"prompt": prompt + " in upper case:\n\n"}


def table_cells(rep: int, contexts: dict, loop: list) -> dict[str, list]:
    """Each cell's rounds for repetition `rep` (a round: requests asked at once)."""
    out: dict[str, list] = {
        "edit turn (text)": [[edit(rep)]],
        f"replayed tool loop, {len(loop)} turns (chat)": [[turn] for turn in loop],
        "prose (chat)": [[prose(rep)]],
    }
    for n in (1, 4, 8):
        out[f"{n} agent{'s' * (n > 1)} at once (edits)"] = [
            [edit(100 * n + 8 * rep + i) for i in range(n)]
        ]
    for label, (text, names) in contexts.items():
        out[f"{label} context (edit)"] = [[edit(rep, text, names[-1 - rep % len(names)])]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=["default", "gemma3-270m"])
    parser.add_argument(
        "--contexts", nargs="*", type=int, default=[2048, 16384], help="long-context cells"
    )
    parser.add_argument("--no-mlx-lm", action="store_true", help="leave mlx_lm.server out")
    parser.add_argument("--cells", nargs="*", default=None, help="only cells starting so")
    parser.add_argument(
        "--detail",
        action="store_true",
        help="print each auto round: tok/s and each row's drafted/kept/passes by source",
    )
    add_run_options(parser)
    args = parser.parse_args()
    set_blas_threads(args.blas_threads)
    print(f"# {machine()}; load average before: {load_average()}")
    print(
        f"# decode tok/s timed by the client (streamed; the first text to the last, over all "
        f"of a round's requests), median of {args.reps} interleaved runs, greedy, "
        f"{args.max_tokens} tokens at most"
    )
    for model in args.models:
        with workdir(args.keep) as tmp:
            run_model(model, tmp, args)
    print(f"# load average after: {load_average()}")


def run_model(model: str, tmp: Path, args: argparse.Namespace) -> None:
    extra = [] if model == "default" else ["--model", model]
    servers: dict[str, Server] = {}
    for mode in ("off", "auto"):
        (tmp / mode).mkdir()
        servers[mode] = Server(
            "kvserve",
            tmp / mode,
            cache_dir=tmp / mode / "cache",
            extra=[*extra, "--speculation", mode],
        ).start()
    if not args.no_mlx_lm:
        (tmp / "mlx_lm").mkdir()
        path = None if model == "default" else GEMMA3_270M.directory(data_dir())
        servers["mlx_lm"] = Server("mlx_lm", tmp / "mlx_lm", model_path=path).start()
    limit = 8192 if model == "default" else 32768  # the models' positions
    contexts = {}
    for n in args.contexts:
        size = min(n, limit - 2 * args.max_tokens - 400)
        label = f"{n // 1024}k" + ("" if size == n else f" ({size // 1024}k: the model's limit)")
        contexts[label] = repository(size)
    print(f"\n## {model}")
    print(
        f"{'cell':44s} {'off':>6s} {'auto':>6s} {'mlx_lm':>7s} {'auto/off':>8s} {'auto/mlx':>8s}"
        "  drafted/kept/passes  prompt  same"
    )
    loop = []  # the recorded loop's first pass, untimed: the turns the chat template takes
    for route, body in warm_up():
        if all(ask(s, route, body, args.max_tokens)[0] for s in (servers["off"], servers["auto"])):
            loop.append((route, body))
    names = list(table_cells(0, contexts, loop))
    names = [n for n in names if not args.cells or n.startswith(tuple(args.cells))]
    for name in names:
        speeds: dict[str, list[float]] = {mode: [] for mode in servers}
        texts: dict[str, list] = {mode: [] for mode in servers}
        spec, prompts, detail = [0, 0, 0], [], []
        for rep in range(args.reps):
            order = list(servers)[rep % len(servers) :] + list(servers)[: rep % len(servers)]
            for rnd in table_cells(rep, contexts, loop)[name]:
                for mode in order:
                    if mode == "mlx_lm" and any(b.get("tool_choice") for _, b in rnd):
                        continue  # mlx_lm.server has no forced tool choice
                    tps, got = round_tps(servers[mode], rnd, args.max_tokens)
                    speeds[mode].append(tps)
                    texts[mode].append(got)
                    if mode == "auto":
                        drafted, lengths, rows = drafting(servers[mode])
                        spec = [a + b for a, b in zip(spec, drafted, strict=True)]
                        prompts += lengths
                        detail += [f"{round(tps, 1)} tok/s {' '.join(rows)}"]
                    elif mode == "off":
                        servers[mode].new_log_lines()
            # a loop's turns are one cell: their decode figures are summed per repetition
        med = {m: statistics.median(v) if v else float("nan") for m, v in speeds.items()}
        same = "yes" if texts["off"] == texts["auto"] else "NO"
        ref = med.get("mlx_lm", float("nan"))
        print(
            f"{name:44s} {med['off']:6.1f} {med['auto']:6.1f} {ref:7.1f} "
            f"{med['auto'] / med['off']:7.2f}x {med['auto'] / ref:7.2f}x  "
            f"{spec[0]:>7d}/{spec[1]}/{spec[2]:<9d} {max(prompts, default=0):>6d}  {same}",
            flush=True,
        )
        if args.detail:  # each round of the auto server: its speed and its rows' sources
            print("\n".join(f"    {line}" for line in detail), flush=True)
    for server in servers.values():
        server.stop()


if __name__ == "__main__":
    main()
