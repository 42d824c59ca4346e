"""Ollama's native request bodies (`/api/chat`, `/api/generate`, `/api/show`, `/api/pull`),
validated as Ollama's Go server binds them (ollama/ollama `api/types.go`).

Unknown fields are ignored, as Go's JSON binding does. `options` is a free map there: a key
Ollama knows must have its type (else a 400 naming it, as `Options.FromMap` refuses it; a
fractional number for an integer option is cut toward zero, as it converts it), a key it does
not know is ignored (Ollama logs "invalid option provided" and goes on). `keep_alive` is
a Go duration string or a number of seconds; negative means for ever. `think` is a bool or a
level.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.schemas import MAX_STOPS, ToolDef, _Body
from mlx_kvserve.json_value import JSON

log = logging.getLogger("mlx_kvserve.api")

ThinkLevel = Literal["low", "medium", "high", "max"]

# Ollama's Options and Runner fields (api/types.go) by JSON name: "int", "float", "bool",
# "str" or "list[str]". Those this server applies are read in `Options`; the others (how
# Ollama's runner uses the GPU, its penalties) are accepted and have no effect here.
OPTION_TYPES = {
    "num_keep": "int",
    "seed": "int",
    "num_predict": "int",
    "top_k": "int",
    "top_p": "float",
    "min_p": "float",
    "typical_p": "float",
    "repeat_last_n": "int",
    "temperature": "float",
    "repeat_penalty": "float",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "stop": "list[str]",
    "num_ctx": "int",
    "num_batch": "int",
    "num_gpu": "int",
    "main_gpu": "int",
    "use_mmap": "bool",
    "num_thread": "int",
    "draft_num_predict": "int",
}
APPLIED = frozenset(
    {"seed", "num_predict", "top_k", "top_p", "temperature", "stop", "num_ctx", "draft_num_predict"}
)
# Ollama's defaults (api.DefaultOptions) where a request leaves an option out.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9
MAX_SEED = 2**64


class Options:
    """The `options` map, checked; the fields this server applies."""

    def __init__(self, raw: JSON) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise APIError(400, "options must be an object", param="options")
        values: dict[str, JSON] = {}
        for key, value in raw.items():
            kind = OPTION_TYPES.get(key)
            if kind is None:
                log.info("ignoring the unknown Ollama option %r", key)
                continue
            if value is not None:
                values[key] = _checked(key, kind, value)
        ignored = sorted(set(values) - APPLIED)
        if ignored:
            log.info("Ollama options without effect here: %s", ", ".join(ignored))
        self.temperature = _float(values.get("temperature"), DEFAULT_TEMPERATURE)
        self.top_p = _float(values.get("top_p"), DEFAULT_TOP_P)
        self.top_k = _int(values.get("top_k"), DEFAULT_TOP_K)
        seed = _int(values.get("seed"), -1)
        self.seed = seed if seed >= 0 else None  # Ollama's -1: a random seed
        predict = _int(values.get("num_predict"), -1)
        self.num_predict = predict if predict > 0 else None  # -1, -2 and 0: no limit
        num_ctx = values.get("num_ctx")
        self.num_ctx = num_ctx if isinstance(num_ctx, int) and num_ctx > 0 else None
        # Ollama's draft length for speculative decoding: 0 opts out; a positive one leaves the
        # depth to the server's controller (docs/speculation.md)
        self.speculative = _int(values.get("draft_num_predict"), -1) != 0
        stop = values.get("stop") or []
        assert isinstance(stop, list)
        self.stop = tuple(str(s) for s in stop if s)
        if not 0 <= self.temperature <= 100:
            raise _invalid("temperature", "must be between 0 and 100")
        if not 0 < self.top_p <= 1:
            raise _invalid("top_p", "must be greater than 0 and at most 1")
        if self.top_k < 0:
            raise _invalid("top_k", "must not be negative")
        if self.seed is not None and self.seed >= MAX_SEED:
            raise _invalid("seed", f"must be below 2**64 (got {self.seed})")
        if len(self.stop) > MAX_STOPS:
            raise _invalid("stop", f"at most {MAX_STOPS} stop sequences")


def _checked(key: str, kind: str, value: JSON) -> JSON:
    """The value if it has the option's type, else a 400 naming the option. A number given to
    an integer option is cut toward zero (Go's JSON reads every number as a float64, and
    `Options.FromMap` converts it with `int64(t)`: `top_k: 1.9` is 1)."""
    if kind == "int":
        if isinstance(value, float) and math.isfinite(value):
            value = int(value)  # toward zero, as Go's conversion
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**64:
            return value
        raise _invalid(key, "must be of type integer")
    if kind == "float":
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _invalid(key, "must be of type number")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise _invalid(key, "must be of type boolean")
    if isinstance(value, str):  # one stop sequence given bare: as the Python client allows
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise _invalid(key, "must be of type array of strings")


def _invalid(key: str, why: str) -> APIError:
    return APIError(400, f"option {key!r} {why}", param=f"options.{key}")


def _float(value: JSON, default: float) -> float:
    return float(value) if isinstance(value, int | float) else default


def _int(value: JSON, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


_GO_DURATION = re.compile(r"^([+-])?((?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+$")
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: JSON) -> float | None:
    """Ollama's `keep_alive`: None when absent, math.inf for a negative one (for ever), else
    seconds. A number is seconds; a string is a Go duration ("5m", "1h30m", "0", "-1m")."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise _bad_keep_alive(value)
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"[+-]?\d+(\.\d+)?", text):  # "0", "-1": seconds, as clients mean
            seconds = float(text)
        elif _GO_DURATION.match(text):
            sign = -1.0 if text.startswith("-") else 1.0
            seconds = sign * sum(float(n) * _GO_UNITS[u] for n, u in _GO_PART.findall(text))
        else:
            raise _bad_keep_alive(value)
    else:
        raise _bad_keep_alive(value)
    if not math.isfinite(seconds):
        raise _bad_keep_alive(value)
    return math.inf if seconds < 0 else seconds


def _bad_keep_alive(value: JSON) -> APIError:
    shown = repr(value)[:40]
    return APIError(
        400,
        f"keep_alive {shown} is not a duration: give seconds, or a duration such as "
        '"5m", "1h30m", "0" (unload) or "-1" (keep loaded)',
        param="keep_alive",
    )


class OllamaFunctionCall(_Body):
    index: int | None = None
    name: Annotated[str, Field(min_length=1)]
    # an object, as Ollama sends and takes it; JSON text is taken too (OpenAI's shape)
    arguments: dict[str, JSON] | str = Field(default_factory=dict)


class OllamaToolCall(_Body):
    id: str | None = None
    function: OllamaFunctionCall


class OllamaMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, value: JSON) -> JSON:
        """Ollama lower-cases the role before it reads it."""
        return value.lower() if isinstance(value, str) else value


class _Generation(_Body):
    model: Annotated[str, Field(min_length=1)]
    format: str | dict[str, JSON] | None = None
    options: dict[str, JSON] | None = None
    stream: bool = True
    keep_alive: str | float | int | None = None
    think: bool | ThinkLevel | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] = 0


class ChatBody(_Generation):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[ToolDef] | None = None


class GenerateBody(_Generation):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None
    images: list[str] | None = None


class NamedModel(_Body):
    """`/api/show` and `/api/pull`: `model`, or the older `name`."""

    model: str | None = None
    name: str | None = None
    verbose: bool = False
    stream: bool = True
    insecure: bool = False

    def wanted(self) -> str:
        wanted = self.model or self.name
        if not wanted:
            raise APIError(400, "model is required", param="model")
        return wanted
