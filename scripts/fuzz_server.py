#!/usr/bin/env python3
"""Long fuzz run against a real server: thousands of hostile requests to every endpoint.

    python scripts/fuzz_server.py                    # 5,000 requests, seed 0
    python scripts/fuzz_server.py --requests 20000 --seed 7 --keep
    python scripts/fuzz_server.py --anthropic        # Claude-Code-shaped Messages bodies only

Requests come from the same hypothesis strategies as tests/server/test_fuzz.py
(tests.support.fuzzing).
Every response is checked: no 5xx, every 4xx in the protocol's error shape (Anthropic's on
/v1/messages, OpenAI's elsewhere), every 200 stream finished the protocol's way ([DONE],
message_stop, response.completed) and free of error events; a request that gets no answer within
--timeout seconds counts as a hang. After each request, GET /health on the same connection must
answer 200.

Printed: requests, 2xx, 4xx, 5xx, contract violations, hangs, broken connections, and the server
log's traceback count. Exit status 1 if any of 5xx, violations, hangs or tracebacks is non-zero.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _bench_common import Server, workdir  # noqa: E402

from tests.support.fuzzing import Probe, anthropic_probes, check, probes, send  # noqa: E402


def run(base_url: str, requests: int, rng_seed: int, timeout: float, strategy=None) -> dict:
    totals: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[int] = collections.Counter()
    problems: list[str] = []
    client = httpx.Client(base_url=base_url, timeout=timeout)

    @seed(rng_seed)
    @settings(
        max_examples=requests,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(probe=probes() if strategy is None else strategy)
    def one(probe: Probe) -> None:
        nonlocal client
        totals["requests"] += 1
        try:
            status, body, streamed = send(client, probe)
        except httpx.TimeoutException:
            totals["hangs"] += 1
            problems.append(f"hang: {probe}")
            client = httpx.Client(base_url=base_url, timeout=timeout)
            return
        except httpx.HTTPError as exc:
            totals["broken connections"] += 1
            problems.append(f"{type(exc).__name__}: {probe}")
            client = httpx.Client(base_url=base_url, timeout=timeout)
            return
        totals[f"{status // 100}xx"] += 1
        statuses[status] += 1
        problem = check(status, body, streamed, probe.path)
        if problem:
            totals["violations"] += 1
            problems.append(f"{problem} <- {probe}")
        if client.get("/health").status_code != 200:
            totals["health failures"] += 1
        if totals["requests"] % 500 == 0:
            print(f"  {totals['requests']} requests: {dict(totals)}", flush=True)

    one()
    client.close()
    return {"totals": totals, "statuses": statuses, "problems": problems}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a hang")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--anthropic", action="store_true", help="only Claude-Code-shaped /v1/messages bodies"
    )
    args = parser.parse_args()
    with workdir(args.keep) as work:
        server = Server("kvserve", work, cache_dir=work / "cache").start()
        started = time.monotonic()
        strategy = anthropic_probes() if args.anthropic else None
        result = run(server.base_url, args.requests, args.seed, args.timeout, strategy)
        elapsed = time.monotonic() - started
        code = server.stop()
        log = server.log_path.read_text(errors="replace") if server.log_path else ""
    totals = result["totals"]
    tracebacks = log.count("Traceback")
    print(f"fuzz: {args.requests} requests, seed {args.seed}, {elapsed:.0f} s")
    for name in (
        "requests",
        "2xx",
        "4xx",
        "5xx",
        "violations",
        "hangs",
        "broken connections",
        "health failures",
    ):
        print(f"  {name:<20}{totals.get(name, 0):>8}")
    print(f"  {'tracebacks in log':<20}{tracebacks:>8}")
    by_status = ", ".join(f"{k}: {v}" for k, v in sorted(result["statuses"].items()))
    print(f"  by status: {by_status}")
    print(f"  {'server exit code':<20}{code!s:>8}")
    for problem in result["problems"][:20]:
        print("  !", problem[:400])
    bad = sum(totals.get(k, 0) for k in ("5xx", "violations", "hangs", "broken connections"))
    return 1 if bad or tracebacks or totals.get("health failures") else 0


if __name__ == "__main__":
    sys.exit(main())
