"""Server settings with one precedence rule: flags > environment > config file > defaults.

Every setting has one name. Its environment variable is ``MLX_KVSERVE_<NAME>`` and its key in the
TOML config file is ``<name>``; `mlx-kvserve serve --help` lists them all.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_kvserve import paths

ENV_PREFIX = "MLX_KVSERVE_"


@dataclass
class Settings:
    """What `serve` needs; the defaults are the safe ones (loopback only, no key)."""

    host: str = field(
        default="127.0.0.1", metadata={"help": "Interface to bind; 0.0.0.0 exposes it."}
    )
    port: int = field(default=8080, metadata={"help": "TCP port (0 picks a free one)."})
    model: str | None = field(
        default=None,
        metadata={"help": "Local mlx-lm model directory or Hugging Face repo id."},
    )
    api_key: str | None = field(
        default=None, metadata={"help": "Require 'Authorization: Bearer <key>' on /v1/*."}
    )
    max_body_bytes: int = field(
        default=16 * 1024 * 1024, metadata={"help": "Largest request body accepted (413 above)."}
    )
    max_queue: int = field(
        default=16, metadata={"help": "Requests waiting for the engine before 503 + Retry-After."}
    )
    keepalive_seconds: float = field(
        default=5.0, metadata={"help": "SSE keep-alive comment interval while a prefill runs."}
    )
    prefill_step: int = field(
        default=512,
        metadata={"help": "Prompt tokens per prefill chunk (cancellation granularity)."},
    )
    shutdown_grace: float = field(
        default=10.0, metadata={"help": "Seconds in-flight requests get to finish on SIGTERM."}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error."})

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def _coerce(name: str, raw: Any) -> Any:
    """Turn an env/config value into the field's type, with an error that names the setting."""
    target = {f.name: f for f in dataclasses.fields(Settings)}[name]
    default = target.default
    try:
        if isinstance(default, bool):
            if isinstance(raw, bool):
                return raw
            return str(raw).strip().lower() in {"1", "true", "yes", "on"}
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return None if raw is None else str(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"setting '{name}': cannot use {raw!r} ({exc})") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """Read the TOML config; unknown keys are an error so typos do not pass silently."""
    if not path.is_file():
        return {}
    with path.open("rb") as fh:
        data = tomllib.load(fh)
    known = set(Settings.option_names())
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path.name}: unknown setting(s) {', '.join(unknown)}")
    return data


def load_settings(flags: dict[str, Any], config_path: Path | None = None) -> Settings:
    """Merge defaults, config file, environment and flags (non-None flags win)."""
    values: dict[str, Any] = {}
    file_values = read_config_file(config_path or paths.config_file())
    for name in Settings.option_names():
        env_value = os.environ.get(ENV_PREFIX + name.upper())
        if flags.get(name) is not None:
            values[name] = flags[name]
        elif env_value is not None:
            values[name] = _coerce(name, env_value)
        elif name in file_values:
            values[name] = _coerce(name, file_values[name])
    return Settings(**values)
