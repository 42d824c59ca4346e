"""One server as a benchmark client sees it: the `openai` SDK, streaming, and what it reports.

A `Side` is mlx-kvserve ("ours") or mlx_lm.server ("peer"), started through `_bench_common`'s
`Server` on the same converted model directory with the same BLAS and prefill step. It times
each streamed request, keeps the bytes our cache wrote across restarts, and for ours measures
every disk restore beside a plain read of the same checkpoint files (`chat_probed`).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _bench_common as bc
import httpx
from _pagecache import evict_page_cache

WARM = [{"role": "user", "content": "Say hello in French."}]
_SERIES = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(?P<value>\S+)")


@dataclass
class Call:
    """One streamed chat request, as the client saw it (perf_counter seconds)."""

    server: str
    agent: int
    turn: int
    prompt: int
    cached: int
    completion: int
    t_send: float
    t_first: float | None
    t_last: float | None
    t_end: float
    text: str = ""
    source: str = ""  # ours: live / ram / disk / cold, from the engine's log line
    event: str = ""

    @property
    def ttft(self) -> float:
        return (self.t_first if self.t_first is not None else self.t_end) - self.t_send

    @property
    def prefilled(self) -> int:
        return self.prompt - self.cached


@dataclass
class DiskHit:
    """A restore from our disk tier beside plain reads of the same files."""

    workload: str
    turn: int
    tokens: int  # cached tokens of the request
    bytes: int  # checkpoint file bytes read by the restore
    files: int
    restore_s: float  # from the mlx_kvserve_cache_restore_seconds histogram
    cold_read_s: float  # plain read of the same files after dropping them from the page cache
    warm_read_s: float  # the same read again, from the page cache
    evict: str  # how the page cache was dropped


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}; comments and bad lines skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SERIES.match(line.strip())
        if m and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                out[m["name"]] = float(m["value"])
    return out


def plain_read(paths: list[Path]) -> float:
    """Seconds to read the files into one pre-touched buffer (no allocation inside the timer)."""
    sizes = [p.stat().st_size for p in paths]
    buf = bytearray(max(sizes, default=0))
    view = memoryview(buf)
    t0 = time.perf_counter()
    for p, n in zip(paths, sizes, strict=True):
        with open(p, "rb", buffering=0) as f:
            got = 0
            while got < n:
                k = f.readinto(view[got:n])
                if not k:
                    break
                got += k
    return time.perf_counter() - t0


class Side:
    """mlx-kvserve ("ours", with a cache directory) or mlx_lm.server ("peer")."""

    def __init__(self, kind: str, work: Path, prefill_step: int) -> None:
        self.name = "ours" if kind == "kvserve" else "peer"
        step = ["--prefill-step", str(prefill_step)]
        if kind != "kvserve":
            step = ["--prefill-step-size", str(prefill_step)]
        self.cache_dir = work / "cache" if kind == "kvserve" else None
        self.server = bc.Server(kind, work, cache_dir=self.cache_dir, extra=step)
        self.client: Any = None
        self.written = 0  # bytes our cache wrote in earlier processes (warm-ups excluded)
        self._base = 0  # bytes_written of this process after its warm-up
        self.restarts = 0
        self.restart_s: list[float] = []
        self.evict = ""

    @property
    def ours(self) -> bool:
        return self.server.kind == "kvserve"

    def start(self) -> Side:
        import openai

        self.server.start()
        self.client = openai.OpenAI(
            base_url=self.server.base_url + "/v1",
            api_key="bench",
            max_retries=0,
            timeout=httpx.Timeout(1800.0, connect=10.0),
        )
        self.chat(WARM, max_tokens=4)  # first-call costs are not prefill costs
        if self.ours:
            self.server.engine_line()
            self._base = int(self.server.wait_writes().get("bytes_written", 0))
        return self

    def stop(self) -> None:
        if self.server.proc is None:
            return
        if self.ours:
            self.written += int(self.server.wait_writes().get("bytes_written", 0)) - self._base
        self.server.stop()

    def restart(self) -> None:
        """SIGTERM, then (ours) drop the checkpoint files from the page cache, start again."""
        t0 = time.perf_counter()
        self.stop()
        if self.ours and self.cache_dir is not None:
            self.evict = evict_page_cache(sorted(self.cache_dir.rglob("*.kvc")))
        self.start()
        self.restarts += 1
        self.restart_s.append(time.perf_counter() - t0)

    def bytes_written(self) -> int:
        now = int(self.server.wait_writes().get("bytes_written", 0)) if self.ours else 0
        return self.written + now - self._base

    def footprint(self) -> dict[str, int]:
        """Ours: the cache's own disk_bytes and the files in its directory."""
        if not self.ours or self.cache_dir is None:
            return {}
        stats = self.server.wait_writes() if self.server.proc else {}
        return {
            "disk_bytes": int(stats.get("disk_bytes", 0)),
            "files_bytes": bc.disk_footprint(self.cache_dir),
            "entries": int(stats.get("entries", 0)),
        }

    # ------------------------------------------------------------------ requests ----------
    def chat(self, messages: list[dict], *, max_tokens: int, agent: int = 0, turn: int = 0) -> Call:
        """One streaming chat request at temperature 0 through the openai SDK."""
        parts: list[str] = []
        first = last = None
        usage = None
        t0 = time.perf_counter()
        stream = self.client.chat.completions.create(
            model=self.server.model_name,
            messages=messages,
            temperature=0.0,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices or []:
                if choice.delta and choice.delta.content:
                    last = time.perf_counter()
                    first = first if first is not None else last
                    parts.append(choice.delta.content)
        end = time.perf_counter()
        details = getattr(usage, "prompt_tokens_details", None)
        return Call(
            server=self.name,
            agent=agent,
            turn=turn,
            prompt=int(getattr(usage, "prompt_tokens", 0) or 0),
            cached=int(getattr(details, "cached_tokens", 0) or 0),
            completion=int(getattr(usage, "completion_tokens", 0) or 0),
            t_send=t0,
            t_first=first,
            t_last=last,
            t_end=end,
            text="".join(parts),
        )

    def chat_probed(
        self, messages: list[dict], *, max_tokens: int, workload: str, turn: int, hits: list
    ) -> Call:
        """`chat`, for requests sent one at a time: ours also gets its cache source, and a
        restore from disk is appended to `hits` beside plain reads of the files it read."""
        if not self.ours:
            return self.chat(messages, max_tokens=max_tokens, turn=turn)
        before = self._probe()
        call = self.chat(messages, max_tokens=max_tokens, turn=turn)
        line = self.server.engine_line()
        call.source = line["source"] if line else ""
        after = self._probe()
        count = "mlx_kvserve_cache_restore_seconds_count" + '{tier="disk"}'
        total = "mlx_kvserve_cache_restore_seconds_sum" + '{tier="disk"}'
        if after["metrics"].get(count, 0) > before["metrics"].get(count, 0):
            keys = [
                k
                for k, e in after["entries"].items()
                if k in before["entries"]
                and e["hits"] > before["entries"][k]["hits"]
                and not before["entries"][k]["in_ram"]
                and before["entries"][k]["disk"] == "written"
            ]
            paths = [p for k in keys for p in self.cache_dir.rglob(f"{k}.kvc")]  # type: ignore[union-attr]
            evict = evict_page_cache(paths)
            cold = plain_read(paths)
            warm = plain_read(paths)
            hits.append(
                DiskHit(
                    workload=workload,
                    turn=turn,
                    tokens=call.cached,
                    bytes=int(after["bytes_read"] - before["bytes_read"]),
                    files=len(paths),
                    restore_s=after["metrics"][total] - before["metrics"].get(total, 0.0),
                    cold_read_s=cold,
                    warm_read_s=warm,
                    evict=evict,
                )
            )
        return call

    def _probe(self) -> dict:
        r = httpx.get(self.server.base_url + "/v1/cache", timeout=60)
        r.raise_for_status()
        data = r.json()
        m = httpx.get(self.server.base_url + "/metrics", timeout=60)
        return {
            "entries": {e["key"]: e for e in data.get("entries_list", [])},
            "bytes_read": int(data.get("bytes_read", 0)),
            "metrics": parse_prometheus(m.text),
        }

    def engine_sources(self) -> list[str]:
        """Ours: the cache sources of the engine log lines since the last look."""
        return [line["source"] for line in self.server.engine_lines()] if self.ours else []
