"""systemd (Linux): a `systemctl --user` unit; logs go to the journal.

Why these directives:
- `Restart=on-failure`: restart after a crash (non-zero exit, SIGKILL, a core dump), not after a
  clean stop; SIGTERM makes the server drain and exit 0.
- `TimeoutStopSec`: systemd sends SIGKILL this long after SIGTERM; longer than the drain.
- `RestartSec` and the start limit: a crash loop cannot spin.
- No `StandardOutput=`: the default is the journal (`journalctl --user -u <unit>`).
A user unit runs while the user is logged in; `loginctl enable-linger` keeps it running after
logout and starts it at boot.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from mlx_kvserve.service.actions import Plan, RemoveFile, Run, Step, WriteFile
from mlx_kvserve.service.runner import Result
from mlx_kvserve.service.spec import ServiceSpec

NAME = "systemd"


def quote(arg: str, *, exec_line: bool = True) -> str:
    """One ExecStart or Environment word in systemd's syntax: double-quoted when needed, with
    `\\` and `"` escaped and `%` (specifiers) doubled; in ExecStart `$` (variable expansion)
    is doubled too. A line break cannot be written safely, so it is refused."""
    if any(c in arg for c in "\n\r\0"):
        raise ValueError(f"a line break or NUL cannot go into a systemd unit: {arg!r}")
    text = arg.replace("%", "%%")
    if exec_line:
        text = text.replace("$", "$$")
    if text and re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def unquote_line(line: str, *, exec_line: bool = True) -> list[str]:
    """Words of a line written with `quote` (enough to read our own units back)."""
    words = [w.replace("%%", "%") for w in shlex.split(line, posix=True)]
    return [w.replace("$$", "$") for w in words] if exec_line else words


class Systemd:
    """Paths and plans for one user unit. `config_home` is a parameter for the tests."""

    def __init__(self, spec_name: str, *, config_home: Path | None = None) -> None:
        self.name = spec_name
        self.unit = f"{spec_name}.service"
        xdg = os.environ.get("XDG_CONFIG_HOME")
        self.config_home = config_home or (Path(xdg) if xdg else Path.home() / ".config")

    @property
    def path(self) -> Path:
        return self.config_home / "systemd" / "user" / self.unit

    def systemctl(self, *args: str) -> tuple[str, ...]:
        return ("systemctl", "--user", *args)

    # ---------------------------------------------------------------- the file ---------------
    def render(self, spec: ServiceSpec) -> bytes:
        env = "\n".join(
            f"Environment={quote(f'{k}={v}', exec_line=False)}" for k, v in spec.environment.items()
        )
        text = f"""\
# Written by `mlx-kvserve service install`: run it again to change the options,
# `mlx-kvserve service uninstall` to remove it.
[Unit]
Description=mlx-kvserve: local LLM server with a persistent prompt cache
StartLimitIntervalSec=300
StartLimitBurst=10

[Service]
Type=exec
ExecStart={" ".join(quote(a) for a in spec.program)}
{env}
Restart=on-failure
RestartSec=2
KillSignal=SIGTERM
TimeoutStopSec={spec.stop_timeout}
SyslogIdentifier={self.name}

[Install]
WantedBy=default.target
"""
        return text.encode()

    def installed_command(self) -> tuple[list[str], dict[str, str]] | None:
        """(ExecStart argv, Environment) read back from the installed unit, or None."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        argv: list[str] = []
        env: dict[str, str] = {}
        for line in text.splitlines():
            key, _, value = line.partition("=")
            if key == "ExecStart":
                argv = unquote_line(value)
            elif key == "Environment":
                for word in unquote_line(value, exec_line=False):
                    name, _, val = word.partition("=")
                    env[name] = val
        return argv, env

    # ---------------------------------------------------------------- the plans --------------
    def install(self, spec: ServiceSpec) -> Plan:
        """Write the unit and start it; an installed unit is restarted with the new options."""
        reload = Run(self.systemctl("daemon-reload"))
        steps: list[Step] = [WriteFile(self.path, self.render(spec)), reload]
        if self.path.exists():
            steps += [
                Run(self.systemctl("enable", self.unit)),
                Run(self.systemctl("restart", self.unit)),
            ]
        else:
            steps.append(Run(self.systemctl("enable", "--now", self.unit)))
        return Plan(
            steps,
            f"installed and started {self.unit} ({self.path}); to keep it running after you "
            "log out, run: loginctl enable-linger",
        )

    def uninstall(self) -> Plan:
        return Plan(
            [
                Run(self.systemctl("disable", "--now", self.unit), may_fail=True),
                RemoveFile(self.path),
                Run(self.systemctl("daemon-reload")),
            ],
            f"removed {self.unit}; the prompt cache is kept",
        )

    def start(self) -> Plan:
        return Plan([Run(self.systemctl("start", self.unit))], f"started {self.unit}")

    def stop(self) -> Plan:
        return Plan([Run(self.systemctl("stop", self.unit))], f"stopped {self.unit}")

    def restart(self) -> Plan:
        return Plan([Run(self.systemctl("restart", self.unit))], f"restarted {self.unit}")

    def status_command(self) -> tuple[str, ...]:
        props = "--property=LoadState,ActiveState,SubState,MainPID"
        return self.systemctl("show", self.unit, props)

    @staticmethod
    def parse_status(result: Result) -> tuple[bool, int | None]:
        """(loaded, pid) from `systemctl show`."""
        if not result.ok:
            return False, None
        props = dict(line.partition("=")[::2] for line in result.output.splitlines() if "=" in line)
        loaded = props.get("LoadState") == "loaded"
        pid = int(props.get("MainPID", "0") or 0)
        running = props.get("ActiveState") == "active" and pid > 0
        return loaded, pid if running else None

    def logs_command(self, lines: int, follow: bool) -> tuple[str, ...]:
        tail = ("--follow",) if follow else ()
        unit = ("--unit", self.unit)
        return ("journalctl", "--user", *unit, "--lines", str(lines), "--no-pager", *tail)
