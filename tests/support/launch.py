"""Run a job of several ranks with `mlx.launch --backend ring` on loopback, for the tests.

The ring backend listens on `--starting-port` + rank for every rank, so a start port from the
kernel's ephemeral range (what binding port 0 gives) can collide at +1 or +2 with another
test's server or job running in parallel ("[ring] Couldn't bind socket (error: 98)"). Start
ports come from below that range, every port of the job is checked free, and a job that still
lost the race to bind is run again.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch"
BIND_FAILED = "Couldn't bind socket"


def free_ports(count: int) -> int:
    """A start port below the ephemeral range whose `count` consecutive ports are all free."""
    while True:
        start = random.randrange(20000, 32000 - count)
        try:
            for port in range(start, start + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return start


def run_job(
    command: list[str], ranks: int, *, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`command` on `ranks` ranks (run from the project root, importable as `tests.*`)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    for _ in range(3):
        start = free_ports(ranks)
        cmd = [LAUNCH, "-n", str(ranks), "--backend", "ring", "--starting-port", str(start)]
        proc = subprocess.run(
            [*cmd, "--", *command],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if BIND_FAILED not in proc.stderr:
            return proc
    return proc


def launch_prefix(ranks: int) -> tuple[str, ...]:
    """`mlx.launch` with the ring backend on loopback, as a prefix for a server's command."""
    start = free_ports(ranks)
    return (LAUNCH, "-n", str(ranks), "--backend", "ring", "--starting-port", str(start), "--")


def on_rank(rank: int, **env: str) -> tuple[str, ...]:
    """A prefix for a job's command that gives `env` to rank `rank` only (tests/support/on_rank.py):
    e.g. `MLX_KVSERVE_FAULTS` to make that rank fail, stall or draw otherwise."""
    script = str(Path(__file__).with_name("on_rank.py"))
    return (sys.executable, script, str(rank), *(f"{k}={v}" for k, v in env.items()), "--")


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the ranks `mlx.launch` (its pid) started on this machine (Linux)."""
    ranks = {}
    children = []  # the launcher starts each rank from a thread of its own
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        children += (task / "children").read_text().split()
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        for item in environ:
            if item.startswith(b"MLX_RANK="):
                ranks[int(item.split(b"=", 1)[1])] = int(child)
    return ranks
