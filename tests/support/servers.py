"""Real `mlx-kvserve serve` processes on ephemeral loopback ports, for the server, client and
cluster tests (the fixtures that start them are tests/support/server_fixtures.py).

Every server uses the real embedded default model unless a test names another. It is fetched
and converted once into the data directory (MLX_KVSERVE_DATA_DIR if set, else the per-user
default) and reused by later runs.

Every server samples with a seed (`--seed`, unless a test sets MLX_KVSERVE_SEED itself): a request
that samples without one of its own (an agent CLI's, an SDK's, a test's at the default
temperature) gets the same answer on every run, so no test passes or fails by the draw.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

SEED = "0"  # the servers' --seed (see above)
STARTUP_TIMEOUT = 900.0  # first run downloads and converts the model; a guard, not a benchmark


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server subprocess with its log captured to a file."""

    def __init__(
        self,
        workdir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """`prefix` runs the server under a wrapper command (e.g. prlimit)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{self.port}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.setdefault("MLX_KVSERVE_CONFIG", str(workdir / "no-config.toml"))
        # Each server gets its own prompt-cache directory unless a test shares one on purpose.
        self.env.setdefault("MLX_KVSERVE_CACHE_DIR", str(workdir / f"cache-{self.port}"))
        self.env.setdefault("MLX_KVSERVE_SEED", SEED)
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "mlx_kvserve",
            "serve",
            "--port",
            str(self.port),
            *args,
        ]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> ServerProcess:
        """Wait for /health's 200. A server that never gets there, or whose caller is stopped
        while it waits (a SIGTERM, Ctrl-C), is stopped here: no caller holds it yet."""
        try:
            return self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, needle: str, timeout: float = 30.0, *, after: int = 0) -> str:
        """Wait until the log holds more than `after` lines containing `needle`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            if sum(needle in line for line in text.splitlines()) > after:
                return text
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} not in server log:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def client_for(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def serve_model(model_dir: Path, *flags: str) -> Iterator[ServerProcess]:
    """A ready server of one model directory (its data directory the model's parent), stopped
    when resumed: a module fixture's body, `yield from serve_model(...)`."""
    proc = ServerProcess(model_dir.parent, "--model", str(model_dir), *flags)
    yield proc.wait_ready()
    proc.stop()
