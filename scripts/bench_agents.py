#!/usr/bin/env python3
"""Agent workloads on mlx-kvserve and mlx_lm.server, side by side, with ratios ours/peer.

    python scripts/bench_agents.py                         # the full run (~20 min on 2 cores)
    python scripts/bench_agents.py --quick                 # tiny sizes: a smoke run
    python scripts/bench_agents.py --plots docs            # also PNG plots (needs matplotlib:
                                                           #   pip install '.[bench]')

Both servers run as child processes on loopback on the same converted default model directory,
with the same optimised BLAS (mlx_lm.server through a launcher that preloads it) and the same
prefill step; every request goes through the official `openai` SDK, streamed, at temperature 0.
Workloads (sizes in `agentbench.workloads.Sizes`, printed at the start):

* agent session: `--turns` turns of growing context with tool results, the history replaced by
  a summary midway, and both servers restarted (SIGTERM, start again) at 70% of the turns;
* agents at once: 4 agents with their own ~2k-token context, 6 turns each, sent concurrently;
* shared system prompt: several conversations over one long system prompt;
* long prompt twice: long prompts, both servers restarted, the same prompts again;
* resident sessions: two conversations alternating in pairs of turns, so that half the turns
  return to a conversation left for the other and half continue the one just served;
* throughput sweep: aggregate decode tok/s with 1..8 agents at once.

Per workload and server: prefilled tokens (prompt - cached, from each server's usage: both
report `prompt_tokens_details.cached_tokens`), TTFT median and max, aggregate decode tok/s,
wall time; for ours the bytes written and final footprint (`GET /v1/cache`). Each restore from
our disk tier (`mlx_kvserve_cache_restore_seconds` in /metrics) is shown beside a plain read of
the same checkpoint files with the page cache dropped (before each restart too, so the restore
reads from the device). Nothing here asserts on time; the exit status is 1 only if a request
failed or a disk hit expected after a restart did not happen.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402
from agentbench import report, workloads  # noqa: E402
from agentbench.side import DiskHit  # noqa: E402

WORKLOADS = ("session", "agents", "shared", "long", "resident", "sweep")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--turns", type=int, default=None, help="agent-session turns (default 20)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    p.add_argument("--out", default="docs/agents-bench.json", help="JSON results ('' for none)")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--prefill-step", type=int, default=512, help="both servers' prefill chunk")
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="run nothing: print the tables (and --plots) of a JSON file written by --out",
    )
    p.add_argument(
        "--only", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}"
    )
    bc.add_run_options(p)
    args = p.parse_args(argv)
    args.sizes = workloads.Sizes.quick() if args.quick else workloads.Sizes()
    if args.turns is not None:
        args.sizes.turns = args.turns
    args.only = [w for w in args.only.split(",") if w]
    unknown = set(args.only) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    return args


def _versions() -> dict[str, str]:
    out = {}
    for name in ("mlx-kvserve", "mlx", "mlx-lm", "openai"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "?"
    return out


def problems(results: list[workloads.Result], hits: list[DiskHit]) -> list[str]:
    """What must hold whatever the timings: answers arrived, restarts were served from disk."""
    out = []
    for r in results:
        for name, calls in r.calls.items():
            empty = [c.turn for c in calls if not c.completion]
            if empty:
                out.append(f"{r.name}: {name} returned no tokens at turns {empty}")
        firsts = [c for c in r.calls["ours"] if c.event == "after restart"]
        if firsts and not any(c.cached > 0 for c in firsts):
            out.append(f"{r.name}: no request after the restart was a cache hit on ours")
        if firsts and not any(h.workload == r.name for h in hits):
            out.append(f"{r.name}: no disk restore seen after the restart")
    return out


def print_report(
    results: list[workloads.Result], hits: list[DiskHit], rows: list[dict], plots: str | None
) -> None:
    """Every table, then the plots (if asked for and matplotlib is there)."""
    print()
    if results:
        print(report.workload_tables(results), end="\n\n")
    session = next((r for r in results if r.name == "agent session"), None)
    if session:
        print(report.turn_table(session), end="\n\n")
    if hits:
        print(report.disk_table(hits), end="\n\n")
    if rows:
        print(report.sweep_table(rows), end="\n\n")
    print(report.targets(results, hits, rows), end="\n\n")
    if plots:
        try:
            for path in report.plots(Path(plots), session, hits, rows):
                print(f"wrote {path}")
        except ImportError:
            print("no plots: matplotlib is not installed (pip install '.[bench]')")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.from_json:
        meta, results, hits, rows = report.load_json(Path(args.from_json))
        print(f"{meta.get('command')} ({meta.get('date')}); machine: {meta.get('machine')}")
        print_report(results, hits, rows, args.plots)
        return 0
    bc.set_blas_threads(args.blas_threads)
    sz, step = args.sizes, args.prefill_step
    print(f"machine: {bc.machine()}; load average {bc.load_average()}")
    print(f"sizes: {dataclasses.asdict(sz)}", flush=True)
    tok = bc.Tokens()
    hits: list[DiskHit] = []
    results: list[workloads.Result] = []
    sweep: dict = {}
    load = [bc.load_average()]
    t0 = time.monotonic()
    with bc.workdir(keep=args.keep) as work:
        if "session" in args.only:
            results.append(workloads.agent_session(work, step, sz, tok, hits))
        if "agents" in args.only:
            results.append(workloads.agents_at_once(work, step, sz, tok))
        if "shared" in args.only:
            results.append(workloads.shared_system(work, step, sz, tok, hits))
        if "long" in args.only:
            results.append(workloads.long_twice(work, step, sz, tok, hits))
        if "resident" in args.only:
            results.append(workloads.resident(work, step, sz, tok, hits))
        load.append(bc.load_average())
        if "sweep" in args.only:
            sweep = workloads.sweep(work, step, sz)
        load.append(bc.load_average())
        model = bc.model_dir().name
    total = time.monotonic() - t0

    print_report(results, hits, report.sweep_summary(sweep), args.plots)
    print(f"(total {total:.0f} s; load average at start / before the sweep / end: {load})")
    words = sys.argv[1:] if argv is None else argv
    meta = {
        "command": " ".join(["python scripts/bench_agents.py", *words]),
        "machine": bc.machine(),
        "python": platform.python_version(),
        "versions": _versions(),
        "model_dir": model,
        "prefill_step": step,
        "sizes": dataclasses.asdict(sz),
        "load_average": load,
        "total_seconds": total,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
    if args.out:
        report.write_json(Path(args.out), meta, results, hits, sweep)
        print(f"wrote {args.out}")
    found = problems(results, hits)
    for p in found:
        print("PROBLEM: " + p)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
