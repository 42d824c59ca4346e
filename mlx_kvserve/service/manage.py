"""Choose the manager, and the read-only actions: `status` and `logs`.

`status` reads the installed file back (the options and environment the service really runs
with), asks the manager whether the job is loaded and its PID, asks the server's own /health,
and measures the log and the prompt-cache directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mlx_kvserve import macos
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.service.launchd import Launchd
from mlx_kvserve.service.runner import Runner
from mlx_kvserve.service.systemd import Systemd

Manager = Launchd | Systemd


def default_manager() -> str | None:
    if macos.on_macos():
        return "launchd"
    if sys.platform.startswith("linux"):
        return "systemd"
    return None


def make_manager(kind: str, name: str) -> Manager:
    return Launchd(name) if kind == "launchd" else Systemd(name)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue  # removed while we walked: the cache evicts as it runs
    return total


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """The service's MLX_KVSERVE_* environment in place of ours, while its settings resolve."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("MLX_KVSERVE_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("MLX_KVSERVE_")})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("MLX_KVSERVE_")]:
            del os.environ[key]
        os.environ.update(saved)


def service_settings(argv: list[str], env: dict[str, str]) -> Settings | None:
    """The settings the installed service runs with: its flags, its environment, its file."""
    from mlx_kvserve.config.flags import add_setting_flags, setting_flags
    from mlx_kvserve.config.precedence import load_settings

    try:
        serve_at = argv.index("serve")
    except ValueError:
        return None
    parser = argparse.ArgumentParser(prog="mlx-kvserve serve")
    add_setting_flags(parser)
    args = parser.parse_args(argv[serve_at + 1 :])
    with _environment(env):
        return load_settings(setting_flags(args))


def health(host: str, port: int, timeout: float = 2.0) -> str:
    """One line: the server's /health answer, or why there is none."""
    if host in ("0.0.0.0", "", "*"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (our own URL)
            body = json.loads(resp.read(65536) or b"{}")
            line = f"{body.get('status', '?')} ({url}: model {body.get('model')})"
            job = body.get("cluster")
            if isinstance(job, dict):  # a job across machines: every rank steps with rank 0
                hosts = ", ".join(f"rank {i} {h}" for i, h in enumerate(job.get("hosts", [])))
                line += f"; {job.get('ranks')} ranks, {job.get('shard')} parallel: {hosts}"
            return line
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code} ({url})"
    except (OSError, ValueError) as exc:
        return f"no answer ({url}: {getattr(exc, 'reason', exc)})"


def status(manager: Manager, runner: Runner, say: Callable[[str], None] = print) -> int:
    """Print the service's state; exit code 0 when it runs and answers /health, else 3."""
    kind = "launchd" if isinstance(manager, Launchd) else "systemd"
    title = manager.label if isinstance(manager, Launchd) else manager.unit
    say(f"service:   {title} ({kind})")
    installed = manager.installed_command()
    if installed is None:
        say(f"installed: no ({manager.path} does not exist)")
        return 3
    say(f"installed: yes ({manager.path})")
    loaded, pid = manager.parse_status(runner.run(manager.status_command()))
    say(f"loaded:    {'yes' if loaded else 'no'}")
    say(f"running:   {f'yes, pid {pid}' if pid else 'no'}")
    answer = "not checked"
    settings = None
    try:
        settings = service_settings(*installed)
    except (ValueError, SystemExit) as exc:
        say(f"config:    the service's settings do not resolve: {exc}")
    if settings is not None and pid:
        answer = health(settings.host, settings.port)
    say(f"health:    {answer}")
    if isinstance(manager, Launchd):
        size = manager.log_path.stat().st_size if manager.log_path.exists() else None
        say(f"log:       {manager.log_path} ({human(size) if size is not None else 'not yet'})")
    else:
        say(f"log:       the journal (journalctl --user --unit {manager.unit})")
    if settings is not None:
        root = settings.cache_root()
        used = human(tree_bytes(root)) if root.exists() else "empty, not created yet"
        say(f"cache:     {root} ({used})")
    return 0 if pid and answer.startswith("ok") else 3


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines of a file, reading only its end."""
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        end = fh.tell()
        block, data = 65536, b""
        while end > 0 and data.count(b"\n") <= count:
            start = max(0, end - block)
            fh.seek(start)
            data = fh.read(end - start) + data
            end = start
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-count:] if count else []


def follow(path: Path, poll: float = 0.5) -> None:
    """Print what is appended to `path` until Ctrl-C; a new file (log rotated) is reopened."""
    fh = path.open("rb")
    fh.seek(0, os.SEEK_END)
    try:
        while True:
            chunk = fh.read()
            if chunk:
                sys.stdout.write(chunk.decode("utf-8", errors="replace"))
                sys.stdout.flush()
                continue
            if path.exists() and path.stat().st_ino != os.fstat(fh.fileno()).st_ino:
                fh.close()
                fh = path.open("rb")
                continue
            time.sleep(poll)
    except KeyboardInterrupt:
        pass
    finally:
        fh.close()


def logs(manager: Manager, runner: Runner, lines: int, follow_: bool) -> int:
    if isinstance(manager, Systemd):
        return runner.stream(manager.logs_command(lines, follow_))
    path = manager.log_path
    if not path.exists():
        print(f"no log yet at {path}")
        return 1
    for line in tail_lines(path, lines):
        print(line)
    if follow_:
        follow(path)
    return 0
