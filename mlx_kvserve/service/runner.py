"""The one place that runs the service manager's commands (launchctl, systemctl, journalctl).

Everything else in `mlx_kvserve.service` only decides what to write and what to run; keeping the
side effects here means `--dry-run` and the tests can swap this boundary for one that prints or
records, and check the exact command lines without a launchd or systemd at hand.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

TIMEOUT = 120.0  # launchctl bootout waits for the server to drain (grace + backstop)


@dataclass(frozen=True)
class Result:
    returncode: int
    output: str  # stdout and stderr together

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Runner(Protocol):
    def run(self, argv: Sequence[str]) -> Result:
        """Run a command to completion and capture what it printed."""
        ...

    def stream(self, argv: Sequence[str]) -> int:
        """Run a command with the terminal as its output (journalctl -f); its exit code."""
        ...


class SystemRunner:
    """Runs the commands for real."""

    def run(self, argv: Sequence[str]) -> Result:
        try:
            done = subprocess.run(
                list(argv),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                timeout=TIMEOUT,
                check=False,
            )
        except FileNotFoundError:
            return Result(127, f"{argv[0]}: command not found")
        except subprocess.TimeoutExpired:
            return Result(124, f"{shlex.join(argv)}: no answer after {TIMEOUT:.0f} s")
        return Result(done.returncode, done.stdout)

    def stream(self, argv: Sequence[str]) -> int:
        try:
            return subprocess.call(list(argv))
        except FileNotFoundError:
            print(f"{argv[0]}: command not found")
            return 127
        except KeyboardInterrupt:  # Ctrl-C ends `logs -f`: that is how it is meant to stop
            return 0
