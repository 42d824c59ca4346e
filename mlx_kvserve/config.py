"""Server settings with one precedence rule: flags > environment > config file > defaults.

Every setting has one name. Its environment variable is ``MLX_KVSERVE_<NAME>`` and its key in the
TOML config file is ``<name>``; `mlx-kvserve serve --help` lists them all.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_kvserve import paths
from mlx_kvserve.config_file import ConfigError, read_config_file, where

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
    max_concurrency: int = field(
        default=8,
        metadata={
            "help": "Most requests decoding together in one batch (1 = one at a time); fewer "
            "run when their KV would not fit in --kv-budget."
        },
    )
    kv_budget: str = field(
        default="auto",
        metadata={
            "help": "Memory for KV beside the weights, e.g. 4GiB: what the running requests "
            "hold (prompt plus a growth reserve each; the youngest pauses when it runs out), "
            "resident sessions, the RAM tier and queued host copies; auto = half of the memory "
            "left beside the model (docs/memory.md). A prompt that cannot fit alone is a 400."
        },
    )
    kv_reserve: int = field(
        default=256,
        metadata={
            "help": "Tokens of KV a request reserves ahead as it grows (and at admission, "
            "beside its prompt)."
        },
    )
    live_budget: str = field(
        default="1GiB",
        metadata={
            "help": "Live KV of recent conversations kept in MLX memory beside the newest one, so "
            "returning to one restores nothing, e.g. 2GiB (0 = keep only the newest)."
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

    served_model_name: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Another name for the served model in /v1/models (repeat the flag or "
            "separate with commas); every name is answered by the loaded model."
        },
    )
    strict_model_names: bool = field(
        default=False,
        metadata={
            "help": "Answer 404 for a model name that is neither the model's id nor a "
            "--served-model-name (by default any name is served by the loaded model)."
        },
    )

    chat_template_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "Default variables for the model's chat template, a JSON object, e.g. "
            "'{\"enable_thinking\": false}'; a request's own chat_template_kwargs and "
            "reasoning controls win."
        },
    )
    thinking_budget: int = field(
        default=0,
        metadata={
            "help": "Most reasoning tokens a thinking model may write before the server ends "
            "its reasoning, when a request sets no budget (0 = no limit)."
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

    def template_defaults(self) -> dict[str, Any]:
        """--chat-template-kwargs as an object (checked when the settings were loaded)."""
        return parse_template_kwargs(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    def model_aliases(self) -> list[str]:
        """The --served-model-name values, in order, without blanks or repeats."""
        return list(dict.fromkeys(self.served_model_name))

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


def _field(name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(Settings)}[name]


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _coerce(name: str, raw: Any) -> Any:
    """Turn an environment string into the field's type; ValueError says what was wrong."""
    target = _field(name)
    if is_list_setting(name):
        return split_list(raw)
    kind = str(target.type)
    if kind == "bool":
        text = str(raw).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ValueError(f"expected 1/0, true/false, yes/no or on/off, got {raw!r}")
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except (TypeError, ValueError):
        wanted = "an integer" if kind == "int" else "a number"
        raise ValueError(f"expected {wanted}, got {raw!r}") from None
    return None if raw is None else str(raw)


def is_list_setting(name: str) -> bool:
    """Settings that take several values (repeated flag, comma-separated env, TOML list)."""
    return str(_field(name).type) == "list[str]"


def split_list(raw: Any) -> list[str]:
    """'a, b' or ['a', 'b,c'] -> ['a', 'b', 'c']: the same list from every source."""
    items = raw if isinstance(raw, list | tuple) else [raw]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_POSITIVE = {"max_body_bytes", "max_queue", "prefill_step", "max_connections", "max_concurrency"}
_POSITIVE |= {"kv_reserve"}
_POSITIVE |= {"keepalive_seconds", "header_timeout", "body_timeout", "idle_timeout"}
_NON_NEGATIVE = {"checkpoint_interval", "blas_threads", "shutdown_grace", "thinking_budget"}


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """A JSON object of chat-template variables; ValueError says what is wrong."""
    from mlx_kvserve.chat.thinking import RESERVED

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    bad = sorted(set(value) & RESERVED)
    if bad:
        raise ValueError(f"{bad[0]!r} is a parameter of the template call, not a variable")
    return value


def check_value(name: str, value: Any) -> Any:
    """One setting's own constraints (types are already right); ValueError if it breaks one."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    if name == "port" and not 0 <= value <= 65535:
        raise ValueError(f"{value} is not a TCP port (0-65535)")
    if name in _POSITIVE and value <= 0:
        raise ValueError("must be positive")
    if name in _NON_NEGATIVE and value < 0:
        raise ValueError(f"{value} is negative")
    if name == "log_level" and str(value).lower() not in _LOG_LEVELS:
        raise ValueError(f"{value!r} is not one of {', '.join(_LOG_LEVELS)}")
    if name == "kv_dtype" and value not in KV_DTYPES:
        raise ValueError(f"{value!r} is not one of {', '.join(KV_DTYPES)}")
    if name in ("cache_budget", "cache_ram_budget", "mlx_cache_limit", "live_budget") and (
        value is not None
    ):
        parse_size(value)
    if name == "kv_budget" and value != "auto":
        parse_size(value)
    if name == "chat_template_kwargs" and value is not None:
        parse_template_kwargs(value)
    return value


@dataclass(frozen=True)
class Source:
    """Where an effective value came from: "flag", "environment", "file" or "default"."""

    kind: str
    detail: str = ""  # the flag, variable, or "file, line N"

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


@dataclass
class Resolved:
    settings: Settings
    sources: dict[str, Source]
    config_path: Path


def resolve_settings(flags: dict[str, Any], config_path: Path | None = None) -> Resolved:
    """Merge defaults, config file, environment and flags (non-None flags win), remembering
    where each value came from. A bad value raises ConfigError naming its source."""
    path = config_path or paths.config_file()
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    file_values = read_config_file(path, fields)
    for name, found in file_values.items():  # a bad line is reported even where overridden
        try:
            value = split_list(found.value) if is_list_setting(name) else found.value
            check_value(name, value)
        except ValueError as exc:
            raise ConfigError(f"{where(path, found.line)}: setting '{name}': {exc}") from None
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for name in Settings.option_names():
        env_name = ENV_PREFIX + name.upper()
        flag = "--" + name.replace("_", "-")
        try:
            if flags.get(name) is not None:
                source = Source("flag", flag)
                raw = flags[name]
                value = split_list(raw) if is_list_setting(name) else raw
            elif os.environ.get(env_name) is not None:
                source = Source("environment", env_name)
                value = _coerce(name, os.environ[env_name])
            elif name in file_values:
                found = file_values[name]
                source = Source("file", where(path, found.line))
                value = split_list(found.value) if is_list_setting(name) else found.value
            else:
                sources[name] = Source("default")
                continue
            values[name] = check_value(name, value)
        except ValueError as exc:
            raise ConfigError(f"{source.detail}: setting '{name}': {exc}") from None
        sources[name] = source
    settings = Settings(**values)
    if settings.isolate_cache and not (settings.api_key or settings.api_keys):
        raise ConfigError(
            f"{sources['isolate_cache'].detail}: setting 'isolate_cache': needs at least one "
            "API key to isolate by"
        )
    return Resolved(settings, sources, path)


def load_settings(flags: dict[str, Any], config_path: Path | None = None) -> Settings:
    """The effective settings (see resolve_settings)."""
    return resolve_settings(flags, config_path).settings
