"""Server settings with one precedence rule: flags > environment > config file > defaults.

Every setting has one name. Its environment variable is ``MLX_KVSERVE_<NAME>`` and its key in the
TOML config file is ``<name>``; `mlx-kvserve serve --help` lists them all.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_kvserve import paths

KV_DTYPES = ("auto", "native", "float32", "float16", "bfloat16")

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
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "Prompt-cache directory (default: the per-user cache directory)."},
    )
    no_cache: bool = field(
        default=False,
        metadata={"help": "Disable the whole prompt cache (RAM, disk and live reuse)."},
    )
    cache_budget: str | None = field(
        default=None,
        metadata={
            "help": "Disk budget per model, e.g. 20GiB (default: min(20 GiB, 25%% of free space))."
        },
    )
    cache_ram_budget: str = field(
        default="2GiB", metadata={"help": "RAM budget for cached KV copies, e.g. 512MiB."}
    )
    kv_dtype: str = field(
        default="auto",
        metadata={
            "help": "Activation and KV dtype: auto (float16 on Metal for a model that computes "
            "in float32, else the model's own), native, float32, float16 or bfloat16."
        },
    )
    mlx_cache_limit: str = field(
        default="512MiB",
        metadata={
            "help": "MLX's buffer cache (freed buffers kept for reuse) is bounded by this and "
            "released after long prefills and restores, e.g. 1GiB (0 = keep none)."
        },
    )
    checkpoint_interval: int = field(
        default=2048,
        metadata={"help": "Checkpoint every N tokens of a long prefill (0 = only at boundaries)."},
    )
    blas_threads: int = field(
        default=0,
        metadata={
            "help": "OpenBLAS threads on the Linux CPU backend (0 = half the cores: idle "
            "OpenBLAS workers spin, so taking every core slows everything else down)."
        },
    )

    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": "Another name for the served model in /v1/models (repeatable, or "
            "comma-separated); every name is answered by the loaded model.",
            "repeatable": True,
        },
    )
    strict_model_names: bool = field(
        default=False,
        metadata={
            "help": "Answer 404 for a model name that is neither the model's id nor a "
            "--served-model-name (by default any name is served by the loaded model)."
        },
    )

    keep_billing_header: bool = field(
        default=False,
        metadata={
            "help": "Keep the per-request 'x-anthropic-billing-header:' line that Claude Code "
            "puts at the start of its system prompt (by default it is dropped: it changes every "
            "request and would force a full re-prefill)."
        },
    )

    def model_aliases(self) -> list[str]:
        """The --served-model-name values, in order, without blanks or repeats."""
        names = [n.strip() for n in (self.served_model_name or "").split(",")]
        return list(dict.fromkeys(n for n in names if n))

    # -- security: who may talk to the server, and how much of it one client may hold ----------
    api_keys: list[str] = field(
        default_factory=list,
        metadata={
            "help": "More accepted API keys besides --api-key, one per client (repeat the flag "
            "or separate with commas)."
        },
    )
    isolate_cache: bool = field(
        default=False,
        metadata={
            "help": "Give each API key its own prompt-cache namespace (directory, RAM tier and "
            "live state), so clients sharing the server cannot probe each other's prompts."
        },
    )
    allowed_hosts: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Host header values accepted besides loopback and the bound address "
            "(name or name:port; repeat or comma-separate). Guards against DNS rebinding."
        },
    )
    allowed_origins: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Web origins (scheme://host[:port]) allowed to call the API from a browser; "
            "CORS is answered only for these. Other cross-origin requests get 403."
        },
    )
    insecure_public: bool = field(
        default=False,
        metadata={"help": "Allow binding a non-loopback address without an API key."},
    )
    max_connections: int = field(
        default=1000,
        metadata={
            "help": "Open connections at most (kept below the open-file limit); when full, "
            "the longest-idle connection is closed to make room."
        },
    )
    header_timeout: float = field(
        default=10.0,
        metadata={"help": "Seconds a connection gets to send a request's headers (slowloris)."},
    )
    body_timeout: float = field(
        default=60.0, metadata={"help": "Seconds a client gets to send a request body (408)."}
    )
    idle_timeout: float = field(
        default=5.0, metadata={"help": "Seconds an idle keep-alive connection stays open."}
    )

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KIB": 1024,
    "M": 1000**2,
    "MB": 1000**2,
    "MIB": 1024**2,
    "G": 1000**3,
    "GB": 1000**3,
    "GIB": 1024**3,
    "T": 1000**4,
    "TB": 1000**4,
    "TIB": 1024**4,
}


def parse_size(text: str | int) -> int:
    """Bytes from '1073741824', '512MiB', '20GB' or '1.5 GiB'."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 20GiB or a byte count)")
    return int(float(match.group(1)) * _UNITS[unit])


def _coerce(name: str, raw: Any) -> Any:
    """Turn an env/config value into the field's type, with an error that names the setting."""
    target = {f.name: f for f in dataclasses.fields(Settings)}[name]
    default = target.default
    if is_list_setting(name):
        return split_list(raw)
    try:
        if isinstance(default, bool):
            if isinstance(raw, bool):
                return raw
            return str(raw).strip().lower() in {"1", "true", "yes", "on"}
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if isinstance(raw, list) and target.metadata.get("repeatable"):
            return ",".join(str(item) for item in raw)
        return None if raw is None else str(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"setting '{name}': cannot use {raw!r} ({exc})") from None


def is_list_setting(name: str) -> bool:
    """Settings that take several values (repeated flag, comma-separated env, TOML list)."""
    target = {f.name: f for f in dataclasses.fields(Settings)}[name]
    return str(target.type) == "list[str]"


def split_list(raw: Any) -> list[str]:
    """'a, b' or ['a', 'b,c'] -> ['a', 'b', 'c']: the same list from every source."""
    items = raw if isinstance(raw, list | tuple) else [raw]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


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
            values[name] = split_list(flags[name]) if is_list_setting(name) else flags[name]
        elif env_value is not None:
            values[name] = _coerce(name, env_value)
        elif name in file_values:
            values[name] = _coerce(name, file_values[name])
    settings = Settings(**values)
    if settings.blas_threads < 0:
        raise ValueError(f"setting 'blas_threads': {settings.blas_threads} is negative")
    for name in ("max_connections", "header_timeout", "body_timeout", "idle_timeout"):
        if getattr(settings, name) <= 0:
            raise ValueError(f"setting '{name}': must be positive")
    if settings.isolate_cache and not (settings.api_key or settings.api_keys):
        raise ValueError("setting 'isolate_cache': needs at least one API key to isolate by")
    if settings.kv_dtype not in KV_DTYPES:
        raise ValueError(f"setting 'kv_dtype': one of {', '.join(KV_DTYPES)}")
    for name in ("cache_budget", "cache_ram_budget", "mlx_cache_limit"):
        value = getattr(settings, name)
        if value is not None:
            try:
                parse_size(value)
            except ValueError as exc:
                raise ValueError(f"setting '{name}': {exc}") from None
    return settings
