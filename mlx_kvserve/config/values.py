"""Single setting values: sizes ('512MiB'), lists ('a, b'), chat-template variables, and each
setting's own constraints. Nothing here knows where a value
came from (config/precedence.py does)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

from mlx_kvserve.json_value import JSON

# The [[models]] tables of the config file: JSON objects, checked whole by models.specs.
ModelTables = list[dict[str, JSON]]
# A setting's value as a source gives it, its type checked (flags and TOML are typed; the
# environment's strings are parsed first).
SettingValue = bool | int | float | str | list[str] | ModelTables | None

KV_DTYPES = ("auto", "native", "float32", "float16", "bfloat16")

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


def split_list(raw: str | Sequence[str]) -> list[str]:
    """'a, b' or ['a', 'b,c'] -> ['a', 'b', 'c']: the same list from every source."""
    items = raw if isinstance(raw, list | tuple) else [raw]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_POSITIVE = {"max_body_bytes", "max_queue", "prefill_step", "max_connections", "max_concurrency"}
_POSITIVE |= {"max_loaded_models", "kv_reserve"}
_POSITIVE |= {"keepalive_seconds", "header_timeout", "body_timeout", "idle_timeout"}
_POSITIVE |= {"peer_timeout", "ring_port"}
_POSITIVE |= {"image_url_timeout", "max_image_bytes", "max_image_pixels"}
IMAGE_MODES = ("note", "reject")
SHARD_MODES = ("auto", "tensor", "pipeline")
SPECULATION_MODES = ("auto", "off")
MTP_MODES = ("auto", "on", "off")
_NON_NEGATIVE = {"checkpoint_interval", "blas_threads", "shutdown_grace", "thinking_budget"}


def parse_template_kwargs(text: str) -> dict[str, JSON]:
    """A JSON object of chat-template variables; ValueError says what is wrong."""
    from mlx_kvserve.chat.reasoning.thinking import RESERVED

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


def check_value(name: str, value: SettingValue) -> SettingValue:
    """One setting's own constraints (types are already right); ValueError if it breaks one."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    if name == "port" and not 0 <= value <= 65535:
        raise ValueError(f"{value} is not a TCP port (0-65535)")
    if name in _POSITIVE and value <= 0:
        raise ValueError("must be positive")
    if name == "seed" and not -1 <= value < 2**64:
        raise ValueError(f"{value} is not a seed (0 to 2^64-1, or -1 for none)")
    if name in _NON_NEGATIVE and value < 0:
        raise ValueError(f"{value} is negative")
    if name == "log_level" and str(value).lower() not in _LOG_LEVELS:
        raise ValueError(f"{value!r} is not one of {', '.join(_LOG_LEVELS)}")
    if name == "shard" and value not in SHARD_MODES:
        raise ValueError(f"{value!r} is not one of {', '.join(SHARD_MODES)}")
    if name == "speculation" and value not in SPECULATION_MODES:
        raise ValueError(f"{value!r} is not one of {', '.join(SPECULATION_MODES)}")
    if name == "mtp" and value not in MTP_MODES:
        raise ValueError(f"{value!r} is not one of {', '.join(MTP_MODES)}")
    if name == "images" and value not in IMAGE_MODES:
        raise ValueError(f"{value!r} is not one of {', '.join(IMAGE_MODES)}")
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
    if name == "keep_alive":
        from mlx_kvserve.models.specs import parse_duration

        parse_duration(value)
    if name == "memory_budget" and value != "auto":
        parse_size(value)
    if name == "model":
        from mlx_kvserve.models.specs import parse_model_flag

        for item in value:
            parse_model_flag(item)
    return value
