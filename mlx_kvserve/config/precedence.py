"""Effective settings with one precedence rule: flags > environment > config file > defaults,
remembering where each value came from (`mlx-kvserve config show`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mlx_kvserve import paths
from mlx_kvserve.config.file import ConfigError, read_config_file, where
from mlx_kvserve.config.setting_types import is_list_setting, setting_type, setting_types
from mlx_kvserve.config.settings import ENV_PREFIX, Settings
from mlx_kvserve.config.values import SettingValue, check_value, split_list

__all__ = ["ConfigError", "Resolved", "Source", "load_settings", "resolve_settings"]

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _coerce(name: str, raw: str) -> SettingValue:
    """Turn an environment string into the field's type; ValueError says what was wrong."""
    if is_list_setting(name):
        return split_list(raw)
    kind = setting_type(name)
    if kind is bool:
        text = str(raw).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ValueError(f"expected 1/0, true/false, yes/no or on/off, got {raw!r}")
    try:
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except (TypeError, ValueError):
        wanted = "an integer" if kind is int else "a number"
        raise ValueError(f"expected {wanted}, got {raw!r}") from None
    return None if raw is None else str(raw)


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


def resolve_settings(flags: dict[str, SettingValue], config_path: Path | None = None) -> Resolved:
    """Merge defaults, config file, environment and flags (non-None flags win), remembering
    where each value came from. A bad value raises ConfigError naming its source."""
    path = config_path or paths.config_file()
    file_values = read_config_file(path, setting_types())
    for name, found in file_values.items():  # a bad line is reported even where overridden
        try:
            value = split_list(found.value) if is_list_setting(name) else found.value
            check_value(name, value)
        except ValueError as exc:
            raise ConfigError(f"{where(path, found.line)}: setting '{name}': {exc}") from None
    values: dict[str, SettingValue] = {}
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
    if "models" in file_values:  # [[models]] tables: the file only
        values["models"] = file_values["models"].value
        sources["models"] = Source("file", where(path, file_values["models"].line))
    settings = Settings(**values)
    if settings.isolate_cache and not (settings.api_key or settings.api_keys):
        raise ConfigError(
            f"{sources['isolate_cache'].detail}: setting 'isolate_cache': needs at least one "
            "API key to isolate by"
        )
    return Resolved(settings, sources, path)


def load_settings(flags: dict[str, SettingValue], config_path: Path | None = None) -> Settings:
    """The effective settings (see resolve_settings)."""
    return resolve_settings(flags, config_path).settings
