"""launchd (macOS): a per-user LaunchAgent, managed with `launchctl` in the gui/<uid> domain.

Why these keys:
- `KeepAlive = {SuccessfulExit: false}`: restart after a crash (non-zero exit or a signal), not
  after a clean stop; SIGTERM makes the server drain and exit 0, so `service stop` stays stopped.
- `ProcessType = Interactive`: macOS throttles the CPU and I/O of `Background` and `Standard`
  agents when the user is idle; inference is what the user is waiting for.
- `ThrottleInterval`: at most one restart every 10 s, so a crash loop cannot spin.
- `ExitTimeOut`: launchd sends SIGKILL this long after SIGTERM; longer than the drain.
- `StandardOutPath`/`StandardErrorPath`: one log file in ~/Library/Logs/mlx-kvserve.
"""

from __future__ import annotations

import os
import plistlib
import re
from pathlib import Path

from mlx_kvserve.json_value import JSON
from mlx_kvserve.service.actions import MakeDir, Plan, RemoveFile, Run, Step, WriteFile
from mlx_kvserve.service.runner import Result
from mlx_kvserve.service.spec import LABEL_PREFIX, ServiceSpec

NAME = "launchd"
THROTTLE_SECONDS = 10


class Launchd:
    """Paths and plans for one LaunchAgent. `home` and `uid` are parameters for the tests."""

    def __init__(self, spec_name: str, *, home: Path | None = None, uid: int | None = None):
        self.name = spec_name
        self.label = LABEL_PREFIX + spec_name
        self.home = home or Path.home()
        self.uid = os.getuid() if uid is None else uid

    @property
    def domain(self) -> str:
        return f"gui/{self.uid}"

    @property
    def target(self) -> str:
        return f"{self.domain}/{self.label}"

    @property
    def path(self) -> Path:
        return self.home / "Library" / "LaunchAgents" / f"{self.label}.plist"

    @property
    def log_path(self) -> Path:
        return self.home / "Library" / "Logs" / "mlx-kvserve" / f"{self.name}.log"

    # ---------------------------------------------------------------- the file ---------------
    def document(self, spec: ServiceSpec) -> dict[str, JSON]:
        return {
            "Label": self.label,
            "ProgramArguments": list(spec.program),
            "EnvironmentVariables": dict(spec.environment),
            "RunAtLoad": True,
            "KeepAlive": {"SuccessfulExit": False},
            "ThrottleInterval": THROTTLE_SECONDS,
            "ProcessType": "Interactive",
            "ExitTimeOut": spec.stop_timeout,
            "StandardOutPath": str(self.log_path),
            "StandardErrorPath": str(self.log_path),
        }

    def render(self, spec: ServiceSpec) -> bytes:
        return plistlib.dumps(self.document(spec), fmt=plistlib.FMT_XML, sort_keys=False)

    def installed(self) -> dict[str, JSON] | None:
        """The installed plist, or None."""
        try:
            with self.path.open("rb") as fh:
                return plistlib.load(fh)
        except FileNotFoundError:
            return None

    def installed_command(self) -> tuple[list[str], dict[str, str]] | None:
        doc = self.installed()
        if doc is None:
            return None
        return list(doc.get("ProgramArguments", [])), dict(doc.get("EnvironmentVariables", {}))

    # ---------------------------------------------------------------- the plans --------------
    def install(self, spec: ServiceSpec) -> Plan:
        """Write the plist and (re)load it: an installed agent is booted out first, so new
        options take effect in place."""
        steps: list[Step] = [MakeDir(self.log_path.parent), WriteFile(self.path, self.render(spec))]
        if self.path.exists():
            steps.append(Run(("launchctl", "bootout", self.target), may_fail=True))
        steps += [
            Run(("launchctl", "enable", self.target)),
            # bootstrap can race the bootout of the previous instance (error 5): try again.
            Run(("launchctl", "bootstrap", self.domain, str(self.path)), retries=3),
        ]
        return Plan(steps, f"installed and started {self.label} ({self.path})")

    def uninstall(self) -> Plan:
        return Plan(
            [Run(("launchctl", "bootout", self.target), may_fail=True), RemoveFile(self.path)],
            f"removed {self.label}; its log ({self.log_path}) and the prompt cache are kept",
        )

    def start(self) -> Plan:
        # Loaded already (the usual case after `stop`): bootstrap fails harmlessly, and
        # kickstart starts the job if it is not running.
        return Plan(
            [
                Run(("launchctl", "bootstrap", self.domain, str(self.path)), may_fail=True),
                Run(("launchctl", "kickstart", self.target)),
            ],
            f"started {self.label}",
        )

    def stop(self) -> Plan:
        # SIGTERM: the server drains and exits 0, which KeepAlive does not restart. The job
        # stays loaded, so it starts again at the next login (RunAtLoad) or with `start`.
        return Plan([Run(("launchctl", "kill", "SIGTERM", self.target))], f"stopped {self.label}")

    def restart(self) -> Plan:
        return Plan([Run(("launchctl", "kickstart", "-k", self.target))], f"restarted {self.label}")

    def status_command(self) -> tuple[str, ...]:
        return ("launchctl", "print", self.target)

    @staticmethod
    def parse_status(result: Result) -> tuple[bool, int | None]:
        """(loaded, pid) from `launchctl print`."""
        if not result.ok:
            return False, None
        pid = re.search(r"^\s*pid = (\d+)\s*$", result.output, re.MULTILINE)
        state = re.search(r"^\s*state = (\S+)", result.output, re.MULTILINE)
        running = state is not None and state.group(1) == "running"
        return True, int(pid.group(1)) if pid and running else None
