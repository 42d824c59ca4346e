"""What a background service runs, independent of the manager that runs it.

The service runs this environment's own interpreter (`sys.executable`, not resolved through
symlinks, so a virtualenv stays a virtualenv) with `-m mlx_kvserve serve` and the options given
to `service install`. API keys never go on the command line, where `ps` shows them to every
user: they travel in the service's environment, inside a 0600 file. The service also gets the
MLX_KVSERVE_* variables of the shell that installed it and the path of the config file, so it
runs with the configuration that `mlx-kvserve config show` showed in that shell.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlx_kvserve import paths
from mlx_kvserve.config.setting_types import is_list_setting
from mlx_kvserve.config.settings import ENV_PREFIX, Settings
from mlx_kvserve.config.values import SettingValue

DEFAULT_NAME = "mlx-kvserve"
LABEL_PREFIX = "io.github."
SECRET_SETTINGS = ("api_key", "api_keys")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_name(name: str) -> str:
    """A service name usable as a launchd label part and a systemd unit name."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"service name {name!r}: use letters, digits, '.', '_' and '-' (at most 64)"
        )
    return name


@dataclass
class ServiceSpec:
    name: str
    program: list[str]  # argv: interpreter, -m mlx_kvserve serve, options
    environment: dict[str, str] = field(default_factory=dict)
    stop_timeout: int = 30  # seconds the manager waits after SIGTERM before SIGKILL


def flag_argv(flags: Mapping[str, SettingValue]) -> list[str]:
    """Setting flags as command-line arguments (the inverse of argparse for our flags)."""
    argv: list[str] = []
    for name in Settings.option_names():
        value = flags.get(name)
        if value is None or name in SECRET_SETTINGS:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif is_list_setting(name):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def _absolute_paths(flags: Mapping[str, SettingValue]) -> dict[str, SettingValue]:
    """Paths made absolute: the service does not start in this shell's directory."""
    out: dict[str, SettingValue] = {}
    for name in ("cache_dir", "hostfile"):
        if flags.get(name):
            out[name] = str(Path(flags[name]).expanduser().absolute())
    models = flags.get("model") or []
    if models:
        out["model"] = [_absolute_model(m) for m in models]
    return out


def _absolute_model(value: str) -> str:
    """`[NAME=]PATH_OR_ID` with a local directory made absolute (a repo id stays as it is)."""
    name, sep, source = value.partition("=")
    if not sep or "/" in name or "~" in name:
        name, source = "", value
    if Path(source).expanduser().exists():
        source = str(Path(source).expanduser().absolute())
    return f"{name}={source}" if name else source


def build_spec(
    name: str,
    flags: Mapping[str, SettingValue],
    settings: Settings,
    environ: Mapping[str, str] | None = None,
    python: str | None = None,
) -> ServiceSpec:
    """The service for `install` with these flags and the settings they resolve to."""
    env = os.environ if environ is None else environ
    flags = {**flags, **_absolute_paths(flags)}
    environment = {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIX)}
    environment.setdefault(ENV_PREFIX + "CONFIG", str(paths.config_file()))
    environment["PYTHONUNBUFFERED"] = "1"  # log lines reach the log as they happen
    if flags.get("api_key"):
        environment[ENV_PREFIX + "API_KEY"] = str(flags["api_key"])
    if flags.get("api_keys"):
        environment[ENV_PREFIX + "API_KEYS"] = ",".join(flags["api_keys"])
    program = [python or sys.executable, "-m", "mlx_kvserve", "serve", *flag_argv(flags)]
    # The engine ends in-flight requests after shutdown_grace and uvicorn gives up 5 s later;
    # the manager's SIGKILL must come after both.
    stop_timeout = int(math.ceil(settings.shutdown_grace)) + 20
    return ServiceSpec(check_name(name), program, environment, stop_timeout)
