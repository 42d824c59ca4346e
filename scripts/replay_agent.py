#!/usr/bin/env python3
"""Replay a 20-turn agent session against a real cache server: prefill, TTFT and disk writes.

    python scripts/replay_agent.py                 # 20 turns, then the same prompts --no-cache
    python scripts/replay_agent.py --quick         # no-cache comparison on a subset of turns
    python scripts/replay_agent.py --turns 12 --summarise-at 6 --restart-at 9

The session, as an agent client sends it (all text generated from a fixed seed):
* a long system prompt (~1,500 tokens of tool descriptions), the same every turn;
* turn 1 is a task; every later turn appends the assistant's previous reply (the server's own
  greedy answer) and a new message of a few hundred tokens: simulated tool output (file
  listings, code, logs) or a user instruction;
* at `--summarise-at` (10) the client replaces all turns so far with one short summary message,
  so the prompt shrinks to the system prompt + summary + the new message (trim-back);
* before `--restart-at` (14) the server is stopped with SIGTERM and started again on the same
  cache directory: that turn must come from disk.

Per turn it prints prompt tokens, cached tokens, prefilled tokens (= prompt - cached), the cache
source (engine log), TTFT and the cache's bytes written so far (`GET /v1/cache` bytes_written,
summed across the restart, since the counter restarts with the process). Totals: bytes written,
the final disk footprint (file sizes in the cache directory) and the conversation's final KV
footprint ((prompt + completion tokens of the last turn) x KV bytes per token, from the model
config and the dtype actually stored). Target: bytes written <= 2x the final KV footprint.

Then the exact same requests (the cache run's message lists, turn by turn) go to a `--no-cache`
server: its TTFT is the cold reference, and its greedy answers must equal the cache server's
(invariant 7: same answers with the cache on and off). A no-cache server keeps no state between
requests, so `--cold-turns` can pick any subset of turns without changing what is compared.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402

TOOLS = [
    ("read_file", "Read a text file from the workspace and return its contents with line numbers."),
    ("write_file", "Create or overwrite a file in the workspace with the given contents."),
    ("edit_file", "Replace one exact occurrence of a string in a file with another string."),
    ("list_dir", "List the entries of a directory with their sizes and permissions."),
    ("grep", "Search files for a regular expression and return matching lines with context."),
    ("run_shell", "Run a shell command in the workspace and return its exit code and output."),
    ("run_tests", "Run the project's test suite, or a subset of it, and return the report."),
    ("git_diff", "Show the uncommitted changes in the workspace as a unified diff."),
    ("git_log", "Show recent commits with their authors, dates and messages."),
    ("web_fetch", "Fetch a documentation page by URL and return it as plain text."),
    ("ask_user", "Ask the user a clarifying question and wait for the answer."),
    ("todo", "Maintain a short list of pending steps for the current task."),
]


def tool_block(rng: random.Random, tok: bc.Tokens, budget: int) -> str:
    """The system prompt: agent instructions plus tool descriptions with JSON-ish schemas."""

    def chunks():
        yield (
            "You are a coding agent working in a local repository. Think step by step, call "
            "one tool at a time, read its result, and keep answers short. Never invent file "
            "contents: read them first. When the task is done, say so and stop."
        )
        i = 0
        while True:
            name, desc = TOOLS[i % len(TOOLS)]
            suffix = "" if i < len(TOOLS) else f"_v{i // len(TOOLS) + 1}"
            params = ", ".join(
                f'"{rng.choice(bc.WORDS)}_{j}": {{"type": "{rng.choice(["string", "integer"])}",'
                f' "description": "{bc.prose(rng, 1)}"}}'
                for j in range(rng.randint(2, 4))
            )
            yield (
                f"## Tool: {name}{suffix}\n{desc} {bc.prose(rng, 2)}\n"
                f'Parameters: {{"type": "object", "properties": {{{params}}}}}'
            )
            i += 1

    return tok.fit(chunks(), budget)


def tool_output(rng: random.Random, tok: bc.Tokens, turn: int, budget: int) -> dict:
    """A new message of about `budget` tokens: tool output, or now and then a user instruction."""
    if turn % 5 == 0:
        role, head = "user", "Good. Next, look at this and tell me what to change:\n"
    else:
        role, head = "tool", f"[result of {TOOLS[turn % len(TOOLS)][0]}]\n"
    makers = [bc.file_listing, bc.code_snippet, bc.log_lines, bc.prose]
    start = turn % len(makers)

    def chunks():
        i = start
        while True:
            yield makers[i % len(makers)](rng)
            i += 1

    return {"role": role, "content": head + tok.fit(chunks(), budget - tok.count(head))}


def summary(rng: random.Random, turn: int) -> dict:
    return {
        "role": "user",
        "content": (
            f"Summary of turns 1-{turn - 1} (older history was dropped to save context): we "
            "listed the repository, read the storage module and its tests, found that the "
            "retry policy ignores the timeout setting, ran the tests (3 failures in the "
            "scheduler), and drafted a patch for the configuration loader. "
            + bc.prose(rng, 2)
            + " Continue from here."
        ),
    }


@dataclass
class Turn:
    n: int
    event: str
    messages: list[dict]
    reply: bc.Reply
    engine: dict | None
    bytes_written: int
    cold: bc.Reply | None = None
    cold_engine: dict | None = None


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--summarise-at", type=int, default=10, help="turn that summarises history")
    p.add_argument("--restart-at", type=int, default=14, help="turn preceded by a restart")
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--message-tokens", type=int, default=220, help="tokens per new message")
    p.add_argument("--max-tokens", type=int, default=32, help="reply length (greedy)")
    p.add_argument(
        "--cold-turns",
        default="default",
        help="turns replayed on the --no-cache server: 'all', 'none', a list such as "
        "1,9,10,14,20, or 'default': the odd turns plus the summarised, restarted and last "
        "turn (keeps the run near 10 minutes on a 2-core CPU)",
    )
    p.add_argument("--quick", action="store_true", help="--cold-turns 1,10,14,20")
    p.add_argument("--seed", type=int, default=0)
    bc.add_run_options(p)
    args = p.parse_args(argv)
    if args.quick and args.cold_turns == "default":
        args.cold_turns = "1,10,14,20"
    if args.cold_turns == "default":
        args.cold = {t for t in range(1, args.turns + 1, 2)}
        args.cold |= {args.summarise_at, args.restart_at, args.turns}
        args.cold &= set(range(1, args.turns + 1))
    elif args.cold_turns == "all":
        args.cold = set(range(1, args.turns + 1))
    elif args.cold_turns == "none":
        args.cold = set()
    else:
        args.cold = {int(t) for t in args.cold_turns.split(",") if t}
    return args


def replay(args, work: Path, client, tok: bc.Tokens) -> tuple[list[Turn], bc.Server, int]:
    rng = random.Random(args.seed)
    system = {"role": "system", "content": tool_block(rng, tok, args.system_tokens)}
    task = {
        "role": "user",
        "content": "Task: the retry policy ignores the configured timeout. Find out why and fix "
        "it. Start by listing the repository.",
    }
    history: list[dict] = [task]
    server = bc.Server("kvserve", work, cache_dir=work / "cache").start()
    print(f"mlx-kvserve (cache in a fresh temp dir); BLAS: {server.blas}")
    # bytes_written restarts with each server process, and the warm-up request writes a small
    # checkpoint of its own: count only what the conversation's requests wrote.
    base = _warm(client, server)
    warm_bytes = base
    written_before = 0
    turns: list[Turn] = []
    for n in range(1, args.turns + 1):
        event = ""
        if n > 1:
            history.append({"role": "assistant", "content": turns[-1].reply.text})
        if n == args.summarise_at:
            history = [summary(rng, n)]
            event = "summarised history"
        if n == args.restart_at:
            written_before += server.wait_writes()["bytes_written"] - base
            server.restart()
            base = _warm(client, server)
            warm_bytes += base
            event = "after restart"
        if n > 1:
            history.append(tool_output(rng, tok, n, args.message_tokens))
        messages = [system, *history]
        reply = bc.chat(client, server, messages, max_tokens=args.max_tokens)
        engine = server.engine_line()
        stats = server.wait_writes()
        written = written_before + stats["bytes_written"] - base
        turn = Turn(n, event, messages, reply, engine, written)
        turns.append(turn)
        _print_turn(turn, header=n == 1)
    return turns, server, warm_bytes


def _warm(client, server: bc.Server) -> int:
    """One short unrelated request (first-call costs); returns bytes_written after it."""
    warm = [{"role": "user", "content": "Say hello in French."}]
    bc.chat(client, server, warm, max_tokens=4)
    server.engine_line()
    return int(server.wait_writes().get("bytes_written", 0))


def cold_replay(args, turns: list[Turn], work: Path, client) -> None:
    """The recorded requests, on a --no-cache server (which keeps no state between them)."""
    todo = [t for t in turns if t.n in args.cold]
    if not todo:
        return
    server = bc.Server("kvserve", work, no_cache=True).start()
    print(
        f"\nthe same requests on a --no-cache server (turns {sorted(t.n for t in todo)}); "
        f"BLAS: {server.blas}"
    )
    _warm(client, server)
    for t in todo:
        t.cold = bc.chat(client, server, t.messages, max_tokens=args.max_tokens)
        t.cold_engine = server.engine_line()
        same = "same answer" if t.cold.text == t.reply.text else "DIFFERENT ANSWER"
        print(f"  turn {t.n:>2}: prompt={t.cold.prompt_tokens} ttft={t.cold.ttft:.2f}s {same}")
    server.stop()


def _print_turn(t: Turn, header: bool = False) -> None:
    if header:
        print(
            f"{'turn':>4} {'prompt':>6} {'cached':>6} {'prefill':>7} {'source':>6} "
            f"{'TTFT':>8} {'written MiB':>11}  event"
        )
    src = t.engine["source"] if t.engine else "?"
    print(
        f"{t.n:>4} {t.reply.prompt_tokens:>6} {t.reply.cached_tokens:>6} "
        f"{t.reply.prompt_tokens - t.reply.cached_tokens:>7} {src:>6} {t.reply.ttft:>7.2f}s "
        f"{t.bytes_written / 2**20:>11.1f}  {t.event}",
        flush=True,
    )


def report(
    args, turns: list[Turn], cache_root: Path, stats: dict, load: list[str], warm_bytes: int
) -> int:
    print("\n## Per turn\n")
    print(
        "| turn | prompt tokens | cached tokens | prefilled | cache source | TTFT | "
        "no-cache TTFT | speed-up | bytes written so far | event |"
    )
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for t in turns:
        cold = f"{t.cold.ttft:.2f} s" if t.cold else "-"
        speed = f"{t.cold.ttft / t.reply.ttft:.1f}x" if t.cold else "-"
        print(
            f"| {t.n} | {t.reply.prompt_tokens} | {t.reply.cached_tokens} | "
            f"{t.reply.prompt_tokens - t.reply.cached_tokens} | "
            f"{t.engine['source'] if t.engine else '?'} | {t.reply.ttft:.2f} s | {cold} | "
            f"{speed} | {t.bytes_written / 2**20:.1f} MiB | {t.event} |"
        )

    last = turns[-1]
    final_tokens = last.reply.prompt_tokens + last.reply.completion_tokens
    per_token, formula = bc.kv_bytes_per_token()
    stored = bc.stored_dtype_bytes(cache_root)
    if stored:
        per_token, formula = bc.kv_bytes_per_token(dtype_bytes=stored[0])
        formula += f" ({stored[1]}, as stored)"
    kv = final_tokens * per_token
    written = last.bytes_written
    footprint = bc.disk_footprint(cache_root)
    prefilled = sum(t.reply.prompt_tokens - t.reply.cached_tokens for t in turns)
    prompt_total = sum(t.reply.prompt_tokens for t in turns)
    ttft_cache = sum(t.reply.ttft for t in turns if t.cold)
    ttft_cold = sum(t.cold.ttft for t in turns if t.cold)
    ratio = written / kv if kv else float("nan")

    print("\n## Totals\n")
    print("| figure | value |")
    print("| --- | ---: |")
    print(f"| prompt tokens sent (all turns) | {prompt_total} |")
    print(f"| prompt tokens prefilled with the cache | {prefilled} |")
    print(f"| KV bytes per token | {per_token} = {formula} |")
    print(f"| final conversation (prompt + completion, last turn) | {final_tokens} tokens |")
    print(f"| final KV footprint | {kv / 2**20:.1f} MiB |")
    print(f"| bytes written to the cache (all turns, both processes) | {written / 2**20:.1f} MiB |")
    print(f"| bytes written / final KV footprint | {ratio:.2f}x |")
    print(
        f"| final disk footprint (files in the cache dir; includes {warm_bytes / 2**20:.1f} MiB "
        f"of the warm-up requests' checkpoints) | {footprint / 2**20:.1f} MiB |"
    )
    print(f"| entries on disk at the end | {stats.get('entries')} |")
    if ttft_cold:
        n = sum(1 for t in turns if t.cold)
        print(
            f"| sum of TTFT over the {n} turns also run --no-cache | cache {ttft_cache:.1f} s, "
            f"no-cache {ttft_cold:.1f} s ({ttft_cold / ttft_cache:.1f}x) |"
        )
    print()
    problems = []
    for t in turns:
        if t.cold and t.cold.text != t.reply.text:
            problems.append(
                f"turn {t.n}: cache answer {t.reply.text!r} != no-cache answer {t.cold.text!r}"
            )
        if t.engine and t.engine["retried"]:
            problems.append(f"turn {t.n}: retried from a cold prefill (a cache entry failed)")
        if t.event == "after restart" and t.reply.cached_tokens <= 0:
            problems.append(f"turn {t.n}: first turn after the restart had cached_tokens=0")
    compared = sum(1 for t in turns if t.cold)
    verdict = "MET" if ratio <= 2 else "MISSED"
    print(f"target: bytes written <= 2x final KV footprint: {ratio:.2f}x {verdict}")
    print(f"greedy answers compared with --no-cache: {compared} turns, {len(problems)} problems")
    print(f"load average (1/5/15 min) at the start / before no-cache / end: {'; '.join(load)}")
    for p in problems:
        print("  - " + p)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    bc.set_blas_threads(args.blas_threads)
    tok = bc.Tokens()
    print(f"machine: {bc.machine()}; load average {bc.load_average()}")
    t0 = time.monotonic()
    load = [bc.load_average()]
    with bc.workdir(keep=args.keep) as work, bc.http_client() as client:
        turns, server, warm_bytes = replay(args, work, client, tok)
        stats = server.wait_writes()
        server.stop()  # clean shutdown: flushes whatever is pending, then we measure the files
        load.append(bc.load_average())
        cold_replay(args, turns, work, client)
        load.append(bc.load_average())
        print(f"\n(total {time.monotonic() - t0:.0f} s)")
        return report(args, turns, work / "cache", stats, load, warm_bytes)


if __name__ == "__main__":
    raise SystemExit(main())
