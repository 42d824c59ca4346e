#!/usr/bin/env python3
"""A conversation restored from disk after a restart: one process against a job of 2 ranks.

    python scripts/bench_cluster_restore.py                      # ~2,000-token context
    python scripts/bench_cluster_restore.py --words 3000 --hidden 1024

A random-weight llama of mlx-lm's own class (`--hidden`, 8 layers, 8 heads, 4 KV heads) is
written once. For 1 rank (a plain `serve`) and for 2 (`mlx.launch -n 2 --backend ring`, tensor
parallel, every rank with its own slice of each checkpoint), the script sends a conversation's
first turn (cold: the whole context is prefilled), stops the server (rank 0's SIGTERM stops
every rank; writes are flushed), starts it again and sends the next turn: every rank restores
its slice from disk (the ranks agree on the entry first) and prefills only the new message.
The time to the first token of each is measured at the client, with the server's own log line
beside it. On this 2-core machine two ranks share the cores, so the cold prefill of the split
is slower than one process; what the restore saves is the ratio within each row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Running:
    """A server of `ranks` ranks on a loopback port, its output in a log file."""

    def __init__(self, model: Path, cache: Path, ranks: int, log: Path) -> None:
        from tests.support.launch import launch_prefix

        self.port = _free_port()
        self.ranks = ranks
        command = [sys.executable, "-m", "mlx_kvserve", "serve", "--port", str(self.port)]
        command += ["--model", str(model), "--cache-dir", str(cache)]
        prefix = list(launch_prefix(ranks)) if ranks > 1 else []
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                prefix + command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=_env()
            )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"the server did not start:\n{log.read_text()[-3000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        from tests.support.launch import rank_pids

        target = self.proc.pid if self.ranks == 1 else rank_pids(self.proc.pid)[0]
        os.kill(target, signal.SIGTERM)
        self.proc.wait(300)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def turn(server: Running, messages: list[dict]) -> tuple[float, int, str]:
    """(seconds to the first token, cached prompt tokens, the answer) of one greedy turn."""
    body = {
        "model": "llama",
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, first, text, cached = time.perf_counter(), None, "", 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content") and first is None:
                    first = time.perf_counter() - started
                text += (choice.get("delta") or {}).get("content") or ""
            if event.get("usage"):
                cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first if first is not None else time.perf_counter() - started, cached, text


def run(model: Path, ranks: int, words: int, work: Path) -> dict:
    cache, log = work / f"cache-{ranks}", work / f"server-{ranks}.log"
    line = "the river town keeps its bicycles in order."
    context = " ".join(f"line {i}: {line}" for i in range(words))
    messages = [{"role": "system", "content": context}, {"role": "user", "content": "Summarise."}]
    server = Running(model, cache, ranks, log)
    turn(server, [{"role": "user", "content": "warm up"}])  # the first pass's one-time costs
    cold, _, answer = turn(server, messages)
    server.stop()
    server = Running(model, cache, ranks, log)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    restored, cached, _ = turn(server, messages)
    server.stop()
    lines = re.findall(r"prompt_tokens=(\d+) cached_tokens=(\d+) cache=(\w+)", log.read_text())
    return {
        "cold": cold,
        "restored": restored,
        "cached": cached,
        "prompt": int(lines[-1][0]),
        "source": lines[-1][2],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--words", type=int, default=180, help="lines of context (~11 tokens each)")
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    from bench_cluster import llama_size  # the same model as the per-token benchmark

    from tests.support.tiny_models import make_model_dir

    size = llama_size(args.hidden)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-restore-") as tmp:
        work = Path(tmp)
        model = make_model_dir(work / "llama", "llama", **size)
        print(
            "| ranks | prompt | cold TTFT | after a restart: TTFT | cached tokens (source) | "
            "cold / restored |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for ranks in args.ranks:
            row = run(model, ranks, args.words, work)
            print(
                f"| {ranks} | {row['prompt']} | {row['cold'] * 1e3:.0f} ms | "
                f"{row['restored'] * 1e3:.0f} ms | {row['cached']} ({row['source']}) | "
                f"{row['cold'] / row['restored']:.1f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
