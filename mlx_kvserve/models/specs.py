"""The models a server may serve: `--model [NAME=]PATH_OR_ID` (repeatable) and the config file's
`[[models]]` tables, read into `ModelSpec`s. The first is the default model.

A spec only names a model; `models.pool` loads it when a request first asks for it, unloads it
after its keep-alive, and swaps it out when memory is short. Durations follow Ollama's
`keep_alive` spelling (`30s`, `5m`, `1h`, or plain seconds); 0 keeps a model loaded for good.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlx_kvserve.json_value import JSON

DEFAULT_KEEP_ALIVE = 30 * 60.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")
_KEYS = {"name", "model", "path", "aliases", "pinned", "keep_alive", "settings"}


def parse_duration(text: str | float | int) -> float:
    """Seconds from `30s`, `5m`, `1h`, `2d`, `250ms` or a plain number of seconds."""
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = _DURATION.match(str(text))
        if match is None:
            raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 5m, 1h or 0)")
        seconds = float(match.group(1)) * _UNITS[(match.group(2) or "").lower() or None]
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 5m, 1h or 0)")
    return seconds


@dataclass(frozen=True)
class ModelSpec:
    """One configured model: the name clients use, where its weights are, and its policy."""

    name: str | None  # None: the model's own id once resolved (its folder or repo name)
    source: str | None  # a directory, a Hugging Face id, or None / "default" for the embedded one
    aliases: tuple[str, ...] = ()
    pinned: bool = False  # never unloaded for idleness or to make room
    keep_alive: float | None = None  # seconds idle before unloading; 0 never; None the default
    settings: Mapping[str, JSON] = field(default_factory=dict)  # per-model serve settings

    def names(self, resolved_id: str) -> list[str]:
        """Every name this model answers to, its own first."""
        return list(dict.fromkeys([self.name or resolved_id, *self.aliases]))


def parse_model_flag(value: str) -> ModelSpec:
    """`NAME=PATH_OR_ID` or `PATH_OR_ID`. A value whose part before `=` could be a path (it holds
    `/` or `~`) is taken whole as the source."""
    value = value.strip()
    if not value:
        raise ValueError("--model needs a value: [NAME=]PATH_OR_ID")
    name, sep, source = value.partition("=")
    if not sep or "/" in name or "~" in name:
        return ModelSpec(None, value)
    name, source = name.strip(), source.strip()
    _check_name(name, "--model")
    if not source:
        raise ValueError(f"--model {value!r}: nothing after '='; use NAME=PATH_OR_ID")
    return ModelSpec(name, source)


def parse_model_table(table: Mapping[str, JSON], where: str) -> ModelSpec:
    """One `[[models]]` table of the config file."""
    if not isinstance(table, Mapping):
        raise ValueError(f"{where}: each [[models]] entry must be a table")
    unknown = set(table) - _KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    source = table.get("model", table.get("path"))
    if source is not None and not isinstance(source, str):
        raise ValueError(f"{where}.model: a directory or Hugging Face id, as a string")
    name = table.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ValueError(f"{where}.name: a string")
        _check_name(name, f"{where}.name")
    aliases = table.get("aliases", [])
    if isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"{where}.aliases: a list of names")
    for alias in aliases:
        _check_name(alias, f"{where}.aliases")
    pinned = table.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ValueError(f"{where}.pinned: true or false")
    keep_alive = table.get("keep_alive")
    try:
        seconds = None if keep_alive is None else parse_duration(keep_alive)
    except ValueError as exc:
        raise ValueError(f"{where}.keep_alive: {exc}") from None
    settings = table.get("settings", {})
    if not isinstance(settings, Mapping):
        raise ValueError(f"{where}.settings: a table of serve settings for this model")
    if name is None and source is None:
        raise ValueError(f"{where}: give the model (a directory or Hugging Face id) or a name")
    return ModelSpec(name, source, tuple(dict.fromkeys(aliases)), pinned, seconds, dict(settings))


def check_model_tables(tables: list[JSON]) -> list[ModelSpec]:
    """Every `[[models]]` table, checked together: each on its own, no name or alias given
    twice, and a local path (one starting with `/`, `~` or `.`) that exists."""
    specs = [parse_model_table(t, f"models[{i}]") for i, t in enumerate(tables)]
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        for name in dict.fromkeys([*([spec.name] if spec.name else []), *spec.aliases]):
            if name in seen:
                raise ValueError(
                    f"models[{i}]: the name {name!r} is already given to models[{seen[name]}]"
                )
            seen[name] = i
        source = spec.source
        if source and source.startswith(("/", "~", ".")) and not Path(source).expanduser().exists():
            raise ValueError(f"models[{i}].model: {source!r} does not exist")
    return specs


def merge_specs(flags: Iterable[ModelSpec], tables: Iterable[ModelSpec]) -> list[ModelSpec]:
    """Flags first (the first is the default), then the file's models not named by a flag. A
    flag naming a model of the file takes the file's policy with the flag's source."""
    by_name = {t.name: t for t in tables if t.name}
    out: list[ModelSpec] = []
    for spec in flags:
        table = by_name.pop(spec.name, None) if spec.name else None
        if table is not None:
            spec = ModelSpec(
                spec.name, spec.source, table.aliases, table.pinned, table.keep_alive,
                table.settings,
            )  # fmt: skip
        out.append(spec)
    out += [t for t in tables if not t.name or t.name in by_name]
    return out or [ModelSpec(None, None)]


def _check_name(name: str, where: str) -> None:
    if not _NAME.match(name):
        raise ValueError(
            f"{where}: {name!r} is not a usable model name (letters, digits and ._:@+- only, "
            "starting with a letter or digit, at most 128 characters)"
        )
