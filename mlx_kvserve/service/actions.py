"""A service action as data: the files to write or remove and the commands to run, in order.

launchd.py and systemd.py build plans; `execute` applies one through a Runner, or prints it for
`--dry-run`. Tests compare plans and the files a real execution leaves behind.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlx_kvserve.durable import replace_file
from mlx_kvserve.paths import ensure_private
from mlx_kvserve.service.runner import Runner


@dataclass(frozen=True)
class WriteFile:
    """Write `data` to `path` (0600: it may carry an API key), replacing it atomically."""

    path: Path
    data: bytes


@dataclass(frozen=True)
class MakeDir:
    """Create a private (0700) directory if missing (e.g. the log directory launchd writes to)."""

    path: Path


@dataclass(frozen=True)
class RemoveFile:
    path: Path


@dataclass(frozen=True)
class Run:
    """A command; `may_fail` marks one whose failure is expected and harmless (unloading a job
    that is not loaded), `retries` one that can race the manager (bootstrap right after bootout)."""

    argv: tuple[str, ...]
    may_fail: bool = False
    retries: int = 0


Step = WriteFile | MakeDir | RemoveFile | Run


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    done_message: str = ""
    secrets: list[str] = field(default_factory=list)  # masked when a dry run prints the plan

    def commands(self) -> list[tuple[str, ...]]:
        return [s.argv for s in self.steps if isinstance(s, Run)]


class ServiceError(Exception):
    """A command failed; the message carries its output."""


def write_file(path: Path, data: bytes) -> None:
    ensure_private(path.parent)  # only a missing directory is created (0700)
    replace_file(path, data, 0o600)


def execute(
    plan: Plan,
    runner: Runner,
    *,
    dry_run: bool,
    say: Callable[[str], None] = print,
    sleep: Callable[[float], None] | None = None,
) -> None:
    """Apply `plan` step by step; with `dry_run`, print each step instead and change nothing."""
    import time

    pause = sleep or time.sleep
    for step in plan.steps:
        if isinstance(step, WriteFile):
            if dry_run:
                text = step.data.decode("utf-8", errors="replace").rstrip("\n")
                for secret in plan.secrets:
                    text = text.replace(secret, "<hidden>")
                say(f"# would write {step.path} (mode 0600):")
                say(text)
            else:
                write_file(step.path, step.data)
        elif isinstance(step, MakeDir):
            if dry_run:
                say(f"# would create {step.path}/ (mode 0700) if missing")
            else:
                ensure_private(step.path)
        elif isinstance(step, RemoveFile):
            if dry_run:
                say(f"# would remove {step.path}")
            else:
                step.path.unlink(missing_ok=True)
        elif dry_run:
            note = "   # may fail harmlessly" if step.may_fail else ""
            say(f"# would run: {shlex.join(step.argv)}{note}")
        else:
            _run(step, runner, pause)
    if plan.done_message and not dry_run:
        say(plan.done_message)


def _run(step: Run, runner: Runner, pause: Callable[[float], None]) -> None:
    for attempt in range(step.retries + 1):
        result = runner.run(step.argv)
        if result.ok or step.may_fail:
            return
        if attempt < step.retries:
            pause(1.0)
    hint = ""
    if "connect to bus" in result.output:
        hint = (
            "\n(no user systemd here: `systemctl --user` needs a login session; over ssh, run "
            "`loginctl enable-linger` once, or review the unit with --dry-run)"
        )
    raise ServiceError(
        f"{shlex.join(step.argv)} failed ({result.returncode}): {result.output.strip()}{hint}"
    )
