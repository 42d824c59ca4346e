#!/usr/bin/env python3
"""Time to first token: cold vs RAM hit vs disk hit after a restart, next to mlx_lm.server.

    python scripts/bench_cache.py                  # 512, 2048, 4096-token prompts (~10 min)
    python scripts/bench_cache.py --quick          # 512 and 2048 only, fewer repeats
    python scripts/bench_cache.py --no-mlx-lm      # skip the mlx_lm.server comparison

Everything runs against real server processes on loopback, one at a time (so that they never
compete for the CPU), with the default model, temperature 0 and `--max-tokens` (8) new tokens:

* each prompt size n is one conversation: a system message of varied text (prose, code, logs,
  file listings) sized so the chat prompt is about n tokens, and a user question. Its greedy
  answer A is recorded on first sight. A *follow-up* is that conversation plus A plus a new
  short user question (a different one for every measurement, so no condition is an exact
  repeat): this is what an agent sends on its next turn.
* **cold**: the follow-up on a `--no-cache` mlx-kvserve (full prefill, median of
  `--cold-repeats`). The cache server's first sight of each conversation is shown too.
* **RAM hit**: the follow-up on the cache server after it has seen the conversation. Sizes are
  interleaved, so the state comes from the RAM tier, not from the in-place live state of the
  previous request.
* **disk hit after restart**: the cache server is stopped with SIGTERM and started again on the
  same cache directory; the first follow-up per size must come from disk (cached_tokens > 0).
* **mlx_lm.server**: the same conversation (cold, first sight), follow-ups (its RAM prompt
  cache), and follow-ups after *its* restart (no disk cache: a full prefill again). It is run
  through a launcher that loads the same optimised BLAS first, with `--prefill-step-size`
  equal to mlx-kvserve's prefill step, so that both compute at the same speed.

Every server gets an unrelated warm-up request after each start (first-call costs are not
prefill costs). TTFT is measured by the client: from sending the request to the first non-empty
content chunk of the stream. Engine-side figures (cache source, prefill seconds, restore time)
come from mlx-kvserve's per-request log line. Nothing here asserts on time: it prints tables.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402

QUESTIONS = [
    "Which log level appears most often above?",
    "Name one function defined in the text.",
    "What is the largest file size listed?",
    "Give the topic of the first paragraph.",
    "How many items per pass does the storage engine handle?",
    "Which file extension is the most common?",
    "Quote the first error message.",
    "What does the first code snippet return?",
    "List two words that appear in the logs.",
    "Which component is mentioned last?",
    "Is there a warning in the logs? Answer yes or no.",
    "What is the default limit of the last function?",
]
WARMUP = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello in French."},
]


@dataclass
class Sample:
    reply: bc.Reply
    engine: dict | None = None


@dataclass
class Row:
    target: int
    conversation: list[dict] = field(default_factory=list)
    answer: str = ""
    first_sight: list[Sample] = field(default_factory=list)
    cold: list[Sample] = field(default_factory=list)
    ram: list[Sample] = field(default_factory=list)
    disk: list[Sample] = field(default_factory=list)
    lm_cold: list[Sample] = field(default_factory=list)
    lm_hit: list[Sample] = field(default_factory=list)
    lm_restart: list[Sample] = field(default_factory=list)
    cache_answers: dict[int, str] = field(default_factory=dict)  # question index -> text
    cold_answers: dict[int, str] = field(default_factory=dict)

    def follow_up(self, q: int) -> list[dict]:
        return self.conversation + [
            {"role": "assistant", "content": self.answer},
            {"role": "user", "content": QUESTIONS[q % len(QUESTIONS)]},
        ]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="512,2048,4096", help="approximate prompt sizes (tokens)")
    p.add_argument("--repeats", type=int, default=3, help="samples per hit condition (median)")
    p.add_argument("--cold-repeats", type=int, default=2, help="samples per cold condition")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per request")
    p.add_argument("--prefill-step", type=int, default=512, help="both servers' prefill chunk")
    p.add_argument("--quick", action="store_true", help="512 and 2048 tokens, 2 repeats, 1 cold")
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx_lm.server comparison")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt text")
    bc.add_run_options(p)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.cold_repeats = "512,2048", 2, 1
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    return args


def build_rows(sizes: list[int], seed: int) -> list[Row]:
    tok = bc.Tokens()
    rows = []
    for i, n in enumerate(sizes):
        rng = random.Random(seed * 1000 + n)
        # ~40 tokens go to the template, the header line and the question.
        body = tok.fit(bc.varied_chunks(rng), max(n - 40, 16))
        system = f"Project notes, volume {i + 1} ({n} tokens). Answer questions about them.\n\n"
        rows.append(
            Row(
                n,
                [
                    {"role": "system", "content": system + body},
                    {"role": "user", "content": "Summarise these notes in one sentence."},
                ],
            )
        )
    return rows


def _sample(client, server: bc.Server, messages: list[dict], max_tokens: int) -> Sample:
    reply = bc.chat(client, server, messages, max_tokens=max_tokens)
    return Sample(reply, server.engine_line())


def _warm(client, server: bc.Server) -> None:
    for _ in range(2):
        _sample(client, server, WARMUP, 4)


def _progress(label: str, row: Row, s: Sample) -> None:
    e = s.engine
    extra = f" source={e['source']} engine_ttft={e['ttft']:.3f}s" if e else ""
    print(
        f"  {label:<18} ~{row.target:>5}: prompt={s.reply.prompt_tokens:>5} "
        f"cached={s.reply.cached_tokens:>5} ttft={s.reply.ttft:7.3f}s{extra}",
        flush=True,
    )


def run_kvserve(args, rows: list[Row], work: Path, client) -> dict:
    """Cache server: first sight, RAM hits, then disk hits after restarts."""
    cache_dir = work / "cache"
    server = bc.Server("kvserve", work, cache_dir=cache_dir, extra=_step(args)).start()
    print(
        f"mlx-kvserve (cache in a fresh temp dir); BLAS: {server.blas}; load {bc.load_average()}",
        flush=True,
    )
    _warm(client, server)
    for row in rows:
        s = _sample(client, server, row.conversation, args.max_tokens)
        row.answer = s.reply.text
        row.first_sight.append(s)
        _progress("first sight", row, s)
    for k in range(args.repeats):
        for row in rows:  # interleaved: each follow-up comes from the RAM tier, not live state
            s = _sample(client, server, row.follow_up(k), args.max_tokens)
            row.ram.append(s)
            row.cache_answers[k] = s.reply.text
            _progress("RAM hit", row, s)
    stats = {"before restart": server.wait_writes()}
    for r in range(args.repeats):
        server.restart()
        print(f"  restarted (SIGTERM + start on the same cache dir), load {bc.load_average()}")
        _warm(client, server)
        for row in rows:
            q = args.repeats + r
            s = _sample(client, server, row.follow_up(q), args.max_tokens)
            row.disk.append(s)
            row.cache_answers[q] = s.reply.text
            _progress("disk hit", row, s)
        stats[f"after restart {r + 1}"] = server.cache_stats()
    server.stop()
    stats["footprint"] = bc.disk_footprint(cache_dir)
    return stats


def run_cold(args, rows: list[Row], work: Path, client) -> None:
    """--no-cache server: every follow-up pays its full prefill."""
    server = bc.Server("kvserve", work, no_cache=True, extra=_step(args)).start()
    print(f"mlx-kvserve --no-cache; BLAS: {server.blas}; load {bc.load_average()}", flush=True)
    _warm(client, server)
    for k in range(args.cold_repeats):
        for row in rows:
            s = _sample(client, server, row.follow_up(k), args.max_tokens)
            row.cold.append(s)
            row.cold_answers[k] = s.reply.text
            _progress("cold (no-cache)", row, s)
    server.stop()


def run_mlx_lm(args, rows: list[Row], work: Path, client) -> None:
    extra = ["--prefill-step-size", str(args.prefill_step)]
    server = bc.Server("mlx_lm", work, extra=extra).start()
    print(f"mlx_lm.server; BLAS: {server.blas}; load {bc.load_average()}", flush=True)
    _warm(client, server)
    for row in rows:
        s = _sample(client, server, row.conversation, args.max_tokens)
        row.lm_cold.append(s)
        _progress("mlx_lm cold", row, s)
    for k in range(args.repeats):
        for row in rows:
            s = _sample(client, server, row.follow_up(k), args.max_tokens)
            row.lm_hit.append(s)
            _progress("mlx_lm hit", row, s)
    for r in range(args.cold_repeats):
        server.restart()
        _warm(client, server)
        for row in rows:
            s = _sample(client, server, row.follow_up(args.repeats + r), args.max_tokens)
            row.lm_restart.append(s)
            _progress("mlx_lm restart", row, s)
    server.stop()


def _step(args) -> list[str]:
    return ["--prefill-step", str(args.prefill_step)]


# ============================================================================ report ==========
def _ttft(samples: list[Sample]) -> float:
    return bc.median([s.reply.ttft for s in samples])


def _cached(samples: list[Sample]) -> str:
    vals = sorted({s.reply.cached_tokens for s in samples})
    return "/".join(str(v) for v in vals) if vals else "-"


def _cell(samples: list[Sample], cached: bool = True) -> str:
    if not samples:
        return "-"
    out = f"{_ttft(samples):.2f} s"
    return out + (f" ({_cached(samples)})" if cached else "")


def _sources(samples: list[Sample]) -> str:
    return "/".join(sorted({s.engine["source"] for s in samples if s.engine})) or "?"


def report(args, rows: list[Row], stats: dict, load: list[str]) -> int:
    tokens = [bc.median([s.reply.prompt_tokens for s in r.cold or r.ram]) for r in rows]
    print()
    print("## Time to first token (median; cached_tokens in brackets)")
    print()
    head = (
        "| prompt tokens | cold TTFT (no-cache) | cache server, first sight | RAM hit TTFT | "
        "disk hit after restart TTFT | disk speed-up vs cold |"
    )
    sep = "| ---: | ---: | ---: | ---: | ---: | ---: |"
    if not args.no_mlx_lm:
        head += " mlx_lm.server cold / hit / after restart |"
        sep += " ---: |"
    print(head)
    print(sep)
    for n, row in zip(tokens, rows, strict=True):
        speedup = _ttft(row.cold) / _ttft(row.disk) if row.disk and row.cold else float("nan")
        line = (
            f"| {n:.0f} | {_cell(row.cold, False)} | {_cell(row.first_sight, False)} | "
            f"{_cell(row.ram)} | {_cell(row.disk)} | {speedup:.1f}x |"
        )
        if not args.no_mlx_lm:
            line += f" {_ttft(row.lm_cold):.2f} s / {_cell(row.lm_hit)} / {_cell(row.lm_restart)} |"
        print(line)

    print()
    print("## Where the hit time goes (mlx-kvserve engine log, medians)")
    print()
    print(
        "| prompt tokens | condition | cache source | prefilled tokens | engine TTFT | "
        "prefill | restore + lookup | client TTFT - engine TTFT |"
    )
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for n, row in zip(tokens, rows, strict=True):
        for label, samples in (("cold", row.cold), ("RAM hit", row.ram), ("disk hit", row.disk)):
            eng = [s for s in samples if s.engine]
            if not eng:
                continue
            ttft = bc.median([s.engine["ttft"] for s in eng])
            pre = bc.median([s.engine["prefill_s"] for s in eng])
            prefilled = bc.median([s.reply.prompt_tokens - s.reply.cached_tokens for s in eng])
            client_gap = bc.median([s.reply.ttft - s.engine["ttft"] for s in eng])
            print(
                f"| {n:.0f} | {label} | {_sources(eng)} | {prefilled:.0f} | {ttft:.3f} s | "
                f"{pre:.3f} s | {max(ttft - pre, 0):.3f} s | {client_gap * 1000:.0f} ms |"
            )

    problems = []
    for row in rows:
        for s in row.disk:
            if s.reply.cached_tokens <= 0:
                problems.append(f"~{row.target}: disk hit after restart had cached_tokens=0")
            if s.engine and s.engine["source"] != "disk":
                problems.append(
                    f"~{row.target}: first request after restart came from "
                    f"'{s.engine['source']}', not disk"
                )
        for s in row.ram:
            if s.engine and s.engine["source"] not in {"ram", "live"}:
                problems.append(f"~{row.target}: RAM-hit request came from {s.engine['source']}")
        for samples in (row.first_sight, row.cold, row.ram, row.disk):
            for s in samples:
                if s.engine and s.engine["retried"]:
                    problems.append(f"~{row.target}: a request was retried cold (cache failure)")
        for q, text in row.cold_answers.items():
            if q in row.cache_answers and row.cache_answers[q] != text:
                problems.append(
                    f"~{row.target} q{q}: cache answer {row.cache_answers[q]!r} != "
                    f"no-cache answer {text!r}"
                )
    compared = sum(len(set(r.cold_answers) & set(r.cache_answers)) for r in rows)

    print()
    c = stats.get("after restart 1") or {}
    b = stats.get("before restart") or {}
    print(
        f"cache before the first restart: {b.get('entries')} entries, "
        f"{b.get('bytes_written', 0) / 2**20:.1f} MiB written; final disk footprint "
        f"{stats.get('footprint', 0) / 2**20:.1f} MiB; after restart 1: "
        f"restores_from_disk={c.get('restores_from_disk')} restore_errors={c.get('restore_errors')}"
    )
    print(f"greedy answers compared cache vs no-cache: {compared}")
    print(f"load average (1/5/15 min) at each phase start and at the end: {'; '.join(load)}")
    target = next((i for i, r in enumerate(rows) if r.target == 2048), None)
    if target is not None and rows[target].disk and rows[target].cold:
        speedup = _ttft(rows[target].cold) / _ttft(rows[target].disk)
        verdict = "MET" if speedup >= 20 else "MISSED"
        print(
            f"target: disk-hit TTFT at 2k tokens >= 20x faster than cold: {speedup:.1f}x {verdict}"
        )
    if problems:
        print("PROBLEMS:")
        for p in problems:
            print("  - " + p)
    else:
        print("no problems: every disk hit after restart had cached_tokens > 0, answers matched")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    bc.set_blas_threads(args.blas_threads)
    rows = build_rows(args.sizes, args.seed)
    print(f"machine: {bc.machine()}; load average {bc.load_average()}")
    load = []
    t0 = time.monotonic()
    with bc.workdir(keep=args.keep) as work, bc.http_client() as client:
        load.append(bc.load_average())
        stats = run_kvserve(args, rows, work, client)
        load.append(bc.load_average())
        run_cold(args, rows, work, client)
        if not args.no_mlx_lm:
            load.append(bc.load_average())
            run_mlx_lm(args, rows, work, client)
        load.append(bc.load_average())
    print(f"\n(total {time.monotonic() - t0:.0f} s)")
    return report(args, rows, stats, load)


if __name__ == "__main__":
    raise SystemExit(main())
