"""What each setting is read as: its type, from its annotation in `Settings`.

A flag, an environment variable and a TOML value are all read by the setting's type (`int`,
`str | None`, `list[str]`), so the flags (config/flags.py), the precedence (config/precedence.py),
the config file and the service files ask here rather than each reading the annotations.
"""

from __future__ import annotations

import typing

from mlx_kvserve.config.settings import Settings

__all__ = ["is_list_setting", "setting_type", "setting_types"]

# Each setting's type, evaluated from its annotation (`int`, `str | None`, `list[str]`): what a
# flag, an environment variable and a TOML value are read as.
_TYPES: dict[str, object] = typing.get_type_hints(Settings)


def setting_types() -> dict[str, object]:
    """Every setting's type, by name, to compare with `is` or `==` (`bool`, `list[str]`, ...)."""
    return dict(_TYPES)


def setting_type(name: str) -> object:
    """The type of setting `name` (see `setting_types`)."""
    return _TYPES[name]


def is_list_setting(name: str) -> bool:
    """Settings that take several values (repeated flag, comma-separated env, TOML list)."""
    return setting_type(name) == list[str]
