"""Shared pieces of the cache benchmarks: real server processes, streaming requests, prompt text.

Nothing here imports MLX: the benchmark process is only an HTTP client. Servers run as child
processes on loopback (`python -m mlx_kvserve serve`, or mlx-lm's own server through a tiny
launcher that loads the same optimised BLAS first, so that both compute at the same speed).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
_LIVE: list[Server] = []  # servers still running; stopped at exit whatever happens
_LOG_LINE = re.compile(
    r"(?P<kind>chat|completion)\S* id=\S+ prompt_tokens=(?P<prompt>\d+) "
    r"cached_tokens=(?P<cached>\d+) cache=(?P<source>\S+) completion_tokens=(?P<completion>\d+) "
    r"ttft=(?P<ttft>[\d.]+)s prefill=(?P<prefill_tps>[\d.]+) tok/s"
)


# ===================================================================== servers ================
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir() -> Path:
    """The converted default model (the directory `mlx-kvserve serve` uses without --model)."""
    from mlx_kvserve.models import default_model_dir
    from mlx_kvserve.paths import data_dir

    return Path(default_model_dir(data_dir()))


def machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu}); "
        f"OpenBLAS threads: {blas_threads()}"
    )


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """--keep and --blas-threads, which every benchmark that starts servers offers."""
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, cache files)")
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=None,
        help="OPENBLAS_NUM_THREADS for every server (default: the servers' own choice)",
    )


def set_blas_threads(n: int | None) -> None:
    """Pin OpenBLAS's thread count in every server started from now on (None: leave it)."""
    if n is not None:
        os.environ["OPENBLAS_NUM_THREADS"] = str(n)


def blas_threads() -> str:
    return os.environ.get("OPENBLAS_NUM_THREADS", "the servers' default")


def load_average() -> str:
    with contextlib.suppress(OSError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "n/a"


@dataclass
class Server:
    """One server child process on a loopback port; its output goes to a log file."""

    kind: str  # "kvserve" or "mlx_lm"
    log_dir: Path
    cache_dir: Path | None = None
    no_cache: bool = False
    extra: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    _log_offset: int = 0
    _pending_lines: list[dict] = field(default_factory=list)
    starts: int = 0
    blas: str = ""
    model_path: Path | None = None  # mlx_lm.server's --model (None: the default model)

    @property
    def model_name(self) -> str:
        if self.kind == "kvserve":
            from mlx_kvserve.models import DEFAULT_MODEL_ID

            return DEFAULT_MODEL_ID
        return "default_model"  # mlx_lm.server's name for its --model

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if self.kind == "kvserve":
            cmd = [sys.executable, "-m", "mlx_kvserve", "serve", "--port", str(self.port)]
            return cmd + (["--no-cache"] if self.no_cache else []) + self.extra
        model = self.model_path or model_dir()
        argv = ["mlx_lm", "server", "--model", str(model), "--port", str(self.port)]
        argv += self.extra
        launcher = (
            "from mlx_kvserve.blas import preload_optimised_blas; "
            "print('BLAS:', preload_optimised_blas() or 'reference', flush=True); "
            f"import runpy, sys; sys.argv = {argv!r}; "
            "runpy.run_module('mlx_lm', run_name='__main__', alter_sys=True)"
        )
        return [sys.executable, "-c", launcher]

    def start(self, timeout: float = 300.0) -> Server:
        """Start the process and wait until GET /health answers 200 (model loaded)."""
        assert self.proc is None, "already running"
        self.port = free_port()
        self.starts += 1
        self.log_path = self.log_dir / f"{self.kind}{'-nocache' if self.no_cache else ''}.log"
        env = dict(os.environ)
        if self.cache_dir is not None:
            env["MLX_KVSERVE_CACHE_DIR"] = str(self.cache_dir)
        env.setdefault("PYTHONUNBUFFERED", "1")
        log = open(self.log_path, "ab")  # noqa: SIM115  (owned by the process's lifetime)
        log.write(f"\n==== start #{self.starts}: {' '.join(self.command()[:4])}\n".encode())
        log.flush()
        self._log_offset = self.log_path.stat().st_size
        self._pending_lines = []
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
        log.close()
        _LIVE.append(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited early; see its log:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    self.blas = self._blas_line()
                    return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.kind} server not healthy after {timeout:.0f} s:\n{self.tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, wait (a clean shutdown flushes pending cache writes), SIGKILL as a backstop."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        with contextlib.suppress(ValueError):
            _LIVE.remove(self)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def restart(self) -> Server:
        self.stop()
        return self.start()

    def _blas_line(self) -> str:
        """What the server reported about its BLAS (thread count included)."""
        with open(self.log_path, "rb") as f:  # type: ignore[arg-type]
            f.seek(self._log_offset)
            text = f.read().decode(errors="replace")
        found = re.findall(r"BLAS: (.+)", text)
        return found[-1].strip() if found else "unknown"

    def tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def new_log_lines(self) -> list[str]:
        """Server log lines written since the last call (or since start)."""
        if self.log_path is None:
            return []
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            data = f.read()
        self._log_offset += len(data)
        return data.decode(errors="replace").splitlines()

    def engine_lines(self) -> list[dict]:
        """Parsed per-request engine log lines (mlx-kvserve only) since the last call."""
        out = []
        for line in self.new_log_lines():
            m = _LOG_LINE.search(line)
            if m:
                d = m.groupdict()
                prompt, cached, tps = int(d["prompt"]), int(d["cached"]), float(d["prefill_tps"])
                out.append(
                    {
                        "prompt": prompt,
                        "cached": cached,
                        "source": d["source"],
                        "ttft": float(d["ttft"]),
                        "prefill_tps": tps,
                        "prefill_s": (prompt - cached) / tps if tps else 0.0,
                        "retried": "retried=" in line,
                    }
                )
        return out

    def engine_line(self, timeout: float = 30.0) -> dict | None:
        """Wait for the next engine log line: it is written once the request, including its
        after-generation checkpoint, is finished, so the engine is idle afterwards."""
        if self.kind != "kvserve":
            return None
        deadline = time.monotonic() + timeout
        while True:
            self._pending_lines.extend(self.engine_lines())
            if self._pending_lines:
                return self._pending_lines.pop(0)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def cache_stats(self) -> dict:
        r = httpx.get(self.base_url + "/v1/cache", timeout=30)
        r.raise_for_status()
        data = r.json()
        data.pop("entries_list", None)
        return data

    def wait_writes(self, timeout: float = 60.0) -> dict:
        """Poll GET /v1/cache until no cache write is pending; returns the last stats."""
        deadline = time.monotonic() + timeout
        stats = self.cache_stats()
        while stats.get("pending_writes") and time.monotonic() < deadline:
            time.sleep(0.1)
            stats = self.cache_stats()
        return stats


def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(timeout=20)


atexit.register(_stop_all)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@contextlib.contextmanager
def workdir(keep: bool = False) -> Iterator[Path]:
    """A private temporary directory for cache dirs and server logs, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="mlx-kvserve-bench-"))
    try:
        yield path
    finally:
        _stop_all()
        if keep:
            print(f"(kept {path})")
        else:
            shutil.rmtree(path, ignore_errors=True)


# ===================================================================== requests ===============
@dataclass
class Reply:
    text: str
    ttft: float  # seconds from sending the request to the first non-empty content chunk
    total: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None


def chat(
    client: httpx.Client, server: Server, messages: list[dict], *, max_tokens: int = 8
) -> Reply:
    """One streaming chat request at temperature 0; times the first content chunk."""
    body = {
        "model": server.model_name,
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    ttft = None
    usage: dict = {}
    finish = None
    t0 = time.perf_counter()
    with client.stream("POST", server.base_url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(content)
                finish = choice.get("finish_reason") or finish
    total = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    return Reply(
        text="".join(parts),
        ttft=ttft if ttft is not None else total,
        total=total,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        finish_reason=finish,
    )


def http_client() -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(900.0, connect=10.0))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_seconds(fn, reps: int) -> float:
    """The median time of `reps` calls of `fn`, after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ===================================================================== text ===================
class Tokens:
    """Counts tokens with the default model's tokenizer (tokenizers only; no MLX)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def fit(self, chunks: Iterator[str], budget: int, sep: str = "\n\n") -> str:
        """Concatenate chunks until the text holds about `budget` tokens (cut at a line)."""
        out: list[str] = []
        used = 0
        for chunk in chunks:
            n = self.count(chunk + sep)
            if used + n > budget:
                lines = chunk.splitlines()
                while lines and used + self.count("\n".join(lines) + sep) > budget:
                    lines.pop()
                if lines:
                    out.append("\n".join(lines))
                break
            out.append(chunk)
            used += n
        return sep.join(out)


WORDS = [
    "cache",
    "prefix",
    "token",
    "model",
    "server",
    "request",
    "stream",
    "latency",
    "budget",
    "checkpoint",
    "disk",
    "memory",
    "layer",
    "attention",
    "buffer",
    "thread",
    "queue",
    "worker",
    "index",
    "entry",
    "parent",
    "delta",
    "snapshot",
    "restore",
    "prefill",
    "decode",
    "sample",
    "logits",
    "window",
    "rotate",
    "anchor",
    "branch",
    "history",
    "summary",
    "agent",
    "tool",
    "shell",
    "file",
    "directory",
    "config",
    "schema",
    "field",
    "value",
    "error",
    "retry",
    "timeout",
    "signal",
    "process",
    "socket",
    "port",
    "health",
    "metric",
    "counter",
    "gauge",
    "histogram",
    "bucket",
    "quantile",
    "window",
    "batch",
    "chunk",
    "offset",
    "length",
    "hash",
    "digest",
    "checksum",
    "header",
    "payload",
    "format",
    "version",
    "fingerprint",
    "weights",
    "tensor",
    "matrix",
    "vector",
    "scale",
    "bias",
    "group",
    "bits",
    "float",
    "integer",
    "string",
    "list",
    "mapping",
    "optional",
    "default",
    "required",
    "example",
    "note",
]

_TOPICS = [
    "the storage engine",
    "the request scheduler",
    "the tokenizer pipeline",
    "the metrics exporter",
    "the configuration loader",
    "the retry policy",
    "the file watcher",
    "the build system",
    "the test harness",
    "the deployment script",
]


def prose(rng: random.Random, sentences: int = 6) -> str:
    """A paragraph of varied, English-like technical text."""
    out = []
    for _ in range(sentences):
        topic = rng.choice(_TOPICS)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
        n = rng.randint(2, 4096)
        out.append(f"In {topic}, the {words} step handles {n} items per pass.".capitalize())
    return " ".join(out)


def code_snippet(rng: random.Random) -> str:
    """A short, plausible Python function with varied names and numbers."""
    a, b, c = rng.sample(WORDS, 3)
    n, m = rng.randint(2, 512), rng.randint(1, 64)
    return textwrap.dedent(
        f'''\
        def {a}_{b}(items, limit={n}):
            """Return the {c} of every item below {n}, {m} at a time."""
            out = []
            for i, item in enumerate(items[:limit]):
                if item.{c} is None or i % {m} == 0:
                    continue
                out.append(item.{c} * {rng.randint(2, 9)} + {rng.randint(0, 99)})
            return out
        '''
    )


def log_lines(rng: random.Random, n: int = 12) -> str:
    levels = ["INFO", "INFO", "INFO", "DEBUG", "WARNING", "ERROR"]
    t = rng.randint(0, 86_000)
    out = []
    for _ in range(n):
        t += rng.randint(0, 40)
        hh, mm, ss = t // 3600, t // 60 % 60, t % 60
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))
        out.append(
            f"2025-03-{rng.randint(1, 28):02d} {hh:02d}:{mm:02d}:{ss:02d} {rng.choice(levels):7s} "
            f"{rng.choice(WORDS)}.{rng.choice(WORDS)}: {words} ({rng.randint(1, 9999)} ms)"
        )
    return "\n".join(out)


def file_listing(rng: random.Random, n: int = 14) -> str:
    out = []
    for _ in range(n):
        parts = [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
        ext = rng.choice([".py", ".md", ".toml", ".json", ".txt", ".rs", ".ts"])
        size = rng.randint(80, 90_000)
        out.append(f"-rw-r--r--  1 dev  staff  {size:>6}  {'/'.join(parts)}{ext}")
    return "\n".join(out)


def varied_chunks(rng: random.Random) -> Iterator[str]:
    """An endless stream of mixed prose, code and logs, for filling prompts to a size."""
    makers = [prose, code_snippet, log_lines, file_listing]
    while True:
        yield rng.choice(makers)(rng)


def kv_bytes_per_token(directory: Path | None = None, dtype_bytes: int = 4) -> tuple[int, str]:
    """2 x layers x kv_heads x head_dim x dtype bytes, from the model's config.json."""
    cfg = json.loads(((directory or model_dir()) / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    n = 2 * layers * kv_heads * head_dim * dtype_bytes
    return n, f"2 x {layers} layers x {kv_heads} KV heads x {head_dim} head dim x {dtype_bytes} B"


def stored_dtype_bytes(cache_root: Path) -> tuple[int, str] | None:
    """The KV dtype actually stored in the cache's entry files: (bytes per element, name).

    Reads one `.kvc` header (layout documented in `mlx_kvserve.cache.codec`): after the 80-byte
    fixed prefix, whose bytes 12..16 give the header length, comes the JSON header listing each
    array's dtype.
    """
    import struct

    from mlx_kvserve.cache import codec

    for path in sorted(cache_root.rglob("*.kvc")):
        with contextlib.suppress(Exception), open(path, "rb") as f:
            prefix = f.read(codec.PREFIX_SIZE)
            (length,) = struct.unpack_from("<I", prefix, 12)
            header = json.loads(f.read(length))
            dtypes = {a["dtype"] for a in header.get("arrays", [])}
            if len(dtypes) == 1:
                name = dtypes.pop()
                return codec.DTYPES[name].itemsize, name
    return None


def disk_footprint(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
