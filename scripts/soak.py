#!/usr/bin/env python3
"""Kill-and-restart soak of the persistent prompt cache, against real server processes.

    python scripts/soak.py                         # 100 kill/restart cycles, then the rebuild
    python scripts/soak.py --iterations 20 --seed 1 --budget 6MiB
    python scripts/soak.py --rebuild-only          # only the index rebuild timing
    python scripts/soak.py --model-kind hybrid --tools --iterations 500 --no-rebuild
    python scripts/soak.py --model-kind window --tools --no-padded-vocab --iterations 20

A `--no-cache` server answers the workload once (a few conversations sharing one system prompt,
greedy): those are the reference outputs. Then `KillLoop` (tests/support/kill_loop.py) starts a
cache server with a small disk budget on the same model, sends requests, SIGKILLs it at a
seeded random moment (right after an answer, mid-stream, mid-request, halfway through writing
an entry file, or idle), restarts it on the same cache directory and goes on, `--iterations`
times; a final clean run sends the interrupted request and the whole workload.

`--model-kind` picks the model (tests/support/soak_models.py):
  default  the embedded SmolLM2-135M (plain attention, trimmable KV), 8 tokens per answer;
  hybrid   a tiny random-weight Qwen3-Next layout (Gated DeltaNet recurrent layers and one
           attention layer) with Qwen3.5's chat template and a thinking budget of 4;
  window   a tiny random-weight Gemma 3 layout (sliding windows of 32 tokens and a global
           layer) with Qwen3's chat template.
Both tiny models are built into the work directory (kept there for the next run with the same
--workdir), answer 48 tokens, and have their `<tool_call>` output row scaled so that about
half their greedy answers open a call. `--padded-vocab` (on by default for them) gives the
embedding more rows than the tokenizer has ids, as Qwen and Gemma 3 checkpoints ship.
`--tools` puts two function tools (tool_choice "auto") in every request; answers are then
compared as content, reasoning and each call's name and arguments, streamed or not.

Printed: kills, requests, failed requests, wrong outputs (differing from the no-cache answer),
entries recovered at restarts, entries evicted (for failure, and for the budget), temporary files
found after restarts, and the seconds per kill cycle. Exit status 1 if any request failed, any
answer was wrong, or any restart check (unclean-shutdown log line, temporary files, disk budget)
did not hold. SIGTERM (`kill <pid>`) ends the loop after the cycle it is in: the final clean run
and the summary of the cycles done follow; a second SIGTERM stops at once. (Ctrl-C stops at once:
the terminal sends it to the servers too, which would count as failed requests.)

The rebuild timing writes 1,000 entries (100 conversations x 10 chained deltas, 30 layers like
the default model but tiny heads so the directory stays ~200 MB) and times PromptCache's start-up
(scan the headers, validate, rebuild the token index), median of three opens.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iterations", type=int, default=100, help="kill/restart cycles (100)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (0)")
    p.add_argument(
        "--budget",
        help="disk budget of the cache server (default 6MiB; hybrid 512KiB, window 256KiB)",
    )
    p.add_argument(
        "--model-kind",
        choices=("default", "hybrid", "window"),
        default="default",
        help="the model the servers load (default: the embedded one)",
    )
    p.add_argument("--tools", action="store_true", help="two function tools in every request")
    p.add_argument(
        "--padded-vocab",
        action=argparse.BooleanOptionalAction,
        help="embedding rows past the tokenizer's ids (default: on for hybrid and window)",
    )
    p.add_argument("--workdir", type=Path, help="keep logs and the cache here (default: temp)")
    p.add_argument("--rebuild-entries", type=int, default=1000, help="entries to rebuild (1000)")
    p.add_argument("--rebuild-only", action="store_true", help="only time the index rebuild")
    p.add_argument("--no-rebuild", action="store_true", help="skip the index rebuild timing")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-cycle progress lines")
    return p.parse_args(argv)


def soak(args: argparse.Namespace, workdir: Path) -> int:
    from mlx_kvserve.config.values import parse_size
    from tests.support.kill_loop import KillLoop
    from tests.support.servers import ServerProcess
    from tests.support.soak_models import BUILDS, rows, soak_target
    from tests.support.soak_workload import RequestFailed, build_workload

    started = time.monotonic()

    def log(message: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - started:8.1f}s] {message}", flush=True)

    kind = args.model_kind
    padded = kind != "default" if args.padded_vocab is None else args.padded_vocab
    budget = args.budget or (BUILDS[kind].budget if kind in BUILDS else "6MiB")
    target = soak_target(kind, workdir, tools=args.tools, padded=padded)
    model = f"{kind} ({rows(padded)} embedding rows)" if kind in BUILDS else kind
    log(f"model {model}, tools {'on' if args.tools else 'off'}")
    reference = ServerProcess(workdir, "--no-cache", *target.server_args).wait_ready()
    try:
        workload = build_workload(reference.base_url, target)
    except RequestFailed as exc:  # nothing to compare with: say so, not a traceback
        print(f"the --no-cache reference server failed a request: {exc}", file=sys.stderr)
        return 1
    finally:
        reference.stop()
    turns = [turn for conversation in workload for turn in conversation]
    calling = sum(bool(turn.expected.calls) for turn in turns)
    log(f"reference answers: {len(turns)} requests, {calling} with tool calls")
    loop = KillLoop(
        workdir, workload, seed=args.seed, budget=parse_size(budget), log=log, target=target
    )
    looped = time.monotonic()
    with _stop_on_signal(log) as stopping:
        report = loop.run(args.iterations, final_pass=True, stop=stopping.is_set)
    per_kill = (time.monotonic() - looped) / max(report.kills, 1)
    print(
        f"\nsoak: {report.kills} of {args.iterations} iterations, seed {args.seed}, "
        f"budget {budget}, model {model}, tools {'on' if args.tools else 'off'}"
    )
    print(f"reference answers with calls:   {calling} of {len(turns)}")
    print("\n".join(report.lines()))
    print(f"wall time:                      {time.monotonic() - started:.0f} s")
    print(f"per kill cycle:                 {per_kill:.1f} s (the loop and the final pass)")
    for problem in report.problems:
        print("PROBLEM:", problem)
    return 1 if report.problems or report.failed_requests or report.wrong_outputs else 0


@contextlib.contextmanager
def _stop_on_signal(log: Callable[[str], None]) -> Iterator[threading.Event]:
    """The first SIGTERM sets the event (the loop ends after its cycle and reports); a second one
    exits as before, and the servers are stopped on the way out."""
    stopping = threading.Event()
    previous = signal.getsignal(signal.SIGTERM)

    def handle(signum: int, frame: object) -> None:
        if stopping.is_set():
            sys.exit(143)
        stopping.set()
        log("SIGTERM: stopping after this cycle (send it again to stop now)")

    signal.signal(signal.SIGTERM, handle)
    try:
        yield stopping
    finally:
        signal.signal(signal.SIGTERM, previous)


def rebuild_timing(n_entries: int, workdir: Path) -> dict[str, float]:
    """1,000 chained delta entries with the default model's layer count; time the start-up."""
    import numpy as np

    from mlx_kvserve.cache import PromptCache
    from tests.support.cache_testing import make_kv

    directory = workdir / "rebuild"
    fingerprint = "rebuild-bench"
    turns, turn_tokens, layers = 10, 100, 30
    conversations = -(-n_entries // turns)
    rng = np.random.default_rng(0)
    cache = PromptCache(directory, fingerprint, disk_budget=1 << 40, ram_budget=0)
    made = 0
    for _ in range(conversations):
        tokens = rng.integers(0, 49_000, size=turns * turn_tokens).tolist()
        for t in range(1, turns + 1):
            if made == n_entries:
                break
            n = t * turn_tokens
            caches = make_kv(n, layers=layers, heads=1, head_dim=8)
            cache.checkpoint(tokens[:n], caches, "message")
            made += 1
        cache.flush()
    cache.close()
    seconds = []
    entries = 0
    for _ in range(3):
        reopened = PromptCache(directory, fingerprint, disk_budget=1 << 40, ram_budget=0)
        seconds.append(reopened.rebuild_seconds)
        entries = len(reopened.entries())
        reopened.close()
    size = sum(p.stat().st_size for p in (directory / fingerprint).glob("*.kvc"))
    return {
        "entries": entries,
        "rebuild_seconds": statistics.median(seconds),
        "bytes": size,
        "longest_tokens": turns * turn_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.model_kind == "default" and args.padded_vocab:
        print("--padded-vocab: the default model is a real checkpoint", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the server the loop is running is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from mlx_kvserve.blas import preload_optimised_blas

    preload_optimised_blas()  # before mlx is imported (the rebuild timing builds KV arrays)
    status = 0
    with tempfile.TemporaryDirectory(prefix="kvserve-soak-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if (workdir / "kv").exists():
            print(f"{workdir / 'kv'} exists: give an empty --workdir", file=sys.stderr)
            return 2
        if not args.rebuild_only:
            status = soak(args, workdir)
        if not args.no_rebuild:
            result = rebuild_timing(args.rebuild_entries, Path(tmp))
            print(
                f"\nindex rebuild: {result['entries']} entries "
                f"({result['bytes'] / 2**20:.0f} MiB, chains up to {result['longest_tokens']} "
                f"tokens) in {result['rebuild_seconds'] * 1000:.0f} ms (median of 3 start-ups)"
            )
    return status


if __name__ == "__main__":
    sys.exit(main())
