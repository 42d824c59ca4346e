"""The macOS-surface run of tests/unit, beside the main run instead of after it.

CI runs the in-process suites twice: once as they are, once with macOS's Python surface
(macos_surface.py). The second run needs nothing the first one holds, and the first leaves
cores idle while its workers wait on server processes (start-ups, polls, kills). With
`MLX_KVSERVE_TEST_MACOS_BESIDE=1` (set by .ci/run) the main session starts the second run as a
niced subprocess at its start, so it takes the idle cores, and at its end waits for it,
prints its summary and fails the session if it failed. Without the variable nothing changes:
`MLX_KVSERVE_TEST_MACOS_OS=1 pytest tests/unit` runs it on its own, as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support import macos_surface

ENV = "MLX_KVSERVE_TEST_MACOS_BESIDE"
NICE = 19  # the main run keeps the cores it uses; this one takes what it leaves
TAIL_LINES = 40  # of the beside run's output, printed at the end of the main run


class BesideRun:
    """One `pytest tests/unit` subprocess with macOS's surface, its output in a file."""

    def __init__(self, rootdir: Path) -> None:
        self.log = Path(tempfile.mkstemp(prefix="macos-unit-", suffix=".log")[1])
        env = {**os.environ, macos_surface.ENV: "1"}
        env.pop(ENV, None)
        cmd = [sys.executable, "-m", "pytest", "tests/unit", "-p", "no:cacheprovider"]
        cmd += ["-n", "1", "--durations=10"]  # one worker: the idle share is about one core
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=rootdir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: os.nice(NICE),
            )

    def finish(self) -> tuple[int, str]:
        """Wait for the run; its exit code and the tail of its output."""
        code = self.proc.wait()
        lines = self.log.read_text(errors="replace").splitlines()
        self.log.unlink(missing_ok=True)
        return code, "\n".join(lines[-TAIL_LINES:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.unlink(missing_ok=True)


def requested(config: pytest.Config) -> bool:
    """Asked for, in the main process of the session (not in an xdist worker)."""
    wanted = os.environ.get(ENV, "").strip().lower() in {"1", "true", "yes"}
    return wanted and not hasattr(config, "workerinput") and not macos_surface.requested()


_run: BesideRun | None = None
_result: tuple[int, str] | None = None


def start(session: pytest.Session) -> None:
    global _run
    if requested(session.config):
        _run = BesideRun(session.config.rootpath)


def finish(session: pytest.Session) -> None:
    """Wait for the beside run (killed if the main run was interrupted) and fold in its result."""
    global _run, _result
    if _run is None:
        return
    run, _run = _run, None
    if session.shouldstop or session.shouldfail:
        run.stop()
        return
    _result = run.finish()
    if _result[0] != 0 and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def report(terminalreporter) -> None:  # noqa: ANN001 (pytest's TerminalReporter)
    if _result is None:
        return
    code, tail = _result
    terminalreporter.section(f"tests/unit with macOS's surface (beside the main run): exit {code}")
    terminalreporter.write_line(tail)
