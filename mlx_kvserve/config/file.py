"""The TOML config file: strict reading with errors that point at a line, and `config init`.

A config file is edited by hand and read by a background service whose errors the user may only
see in a log, so every problem names the key, the file and the line: an unknown key (a typo
would otherwise pass silently), a value of the wrong TOML type (`port = "80"`), or a value the
setting refuses. tomllib reports no positions for keys, so the line is found by scanning the
text for the key's assignment.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import json
import math
import re
import textwrap
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mlx_kvserve import durable, paths
from mlx_kvserve.config.values import ModelTables, SettingValue
from mlx_kvserve.json_value import JSON


class ConfigError(ValueError):
    """A setting that cannot be used; the message says where it came from."""


@dataclass(frozen=True)
class FileValue:
    """A value read from the config file, with the line it was set on (None if not found)."""

    value: SettingValue
    line: int | None


# `key =`, `"key" =`, `'key' =`, or the first part of a dotted key `key.sub =`.
_ASSIGN = re.compile(r"""^\s*(?:"([^"\\]*)"|'([^']*)'|([A-Za-z0-9_-]+))\s*[.=]""")
_TABLE = re.compile(r"""^\s*\[\[?\s*(?:"([^"\\]*)"|'([^']*)'|([A-Za-z0-9_-]+))""")


def key_lines(text: str) -> dict[str, int]:
    """Top-level key -> first line (1-based) that sets it or opens a table of that name."""
    lines: dict[str, int] = {}
    in_table = False
    # TOML ends lines at \n only; str.splitlines() would also split at U+0085, U+2028, ...
    for number, line in enumerate(text.split("\n"), start=1):
        table = _TABLE.match(line)
        if table:
            in_table = True
            name = next(g for g in table.groups() if g is not None)
            lines.setdefault(name, number)
            continue
        assign = _ASSIGN.match(line)
        if assign and not in_table:
            name = next(g for g in assign.groups() if g is not None)
            lines.setdefault(name, number)
    return lines


def where(path: Path, line: int | None) -> str:
    return f"{path}, line {line}" if line else str(path)


def read_config_file(path: Path, types: Mapping[str, object]) -> dict[str, FileValue]:
    """The file's settings with their lines; {} if there is no file. Raises ConfigError.
    `types` maps each setting's name to its type (config.setting_types.setting_type)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    lines = key_lines(text)
    out: dict[str, FileValue] = {}
    for key, value in data.items():
        line = lines.get(key)
        if key not in types:
            near = difflib.get_close_matches(key, list(types), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"{where(path, line)}: unknown setting '{key}'{hint}")
        try:
            checked = check_type(types[key], value)
        except ValueError as exc:
            raise ConfigError(f"{where(path, line)}: setting '{key}': {exc}") from None
        out[key] = FileValue(checked, line)
    return out


def _type_name(value: JSON) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def check_type(kind: object, value: JSON) -> SettingValue:
    """A TOML value for a setting of type `kind`, or ValueError: TOML is typed, so `port = "80"`
    is refused instead of guessed at (the environment, which has only strings, is parsed
    instead). A TOML value is JSON's kind of value (tables, arrays, scalars), dates aside."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {_type_name(value)}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"expected an integer, got {_type_name(value)} {value!r}"[:200])
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"expected a finite number, got {value!r}")
            return float(value)
        raise ValueError(f"expected a number, got {_type_name(value)}")
    if kind == ModelTables:  # [[models]]: checked whole by models.specs
        from mlx_kvserve.models.specs import check_model_tables

        if not isinstance(value, list):
            raise ValueError("expected [[models]] tables")
        check_model_tables(value)
        return value
    if kind == list[str]:
        items = value if isinstance(value, list) else [value]
        if all(isinstance(item, str) for item in items):
            return items
        raise ValueError("expected a string or an array of strings")
    if isinstance(value, str):
        return value
    raise ValueError(f"expected a string, got {_type_name(value)}")


# Values shown for settings that are unset by default (uncommenting one sets it).
_EXAMPLES = {
    "model": ["mlx-community/Qwen2.5-Coder-7B-Instruct-4bit"],
    "api_key": "a-long-random-secret",
    "cache_dir": "~/mlx-kvserve-cache",
    "cache_budget": "20GiB",
    "served_model_name": "gpt-4o-mini",
}


def toml_value(value: SettingValue) -> str:
    """`value` as a TOML literal (JSON string escapes are valid TOML basic strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def default_config_text(fields: list[dataclasses.Field], env_prefix: str) -> str:
    """A config file with every setting commented out at its default, and what it does."""
    out = [
        "# mlx-kvserve configuration (TOML). Every setting is commented out at its default;",
        "# uncomment a line to change it. Precedence: command-line flag > environment variable",
        f"# ({env_prefix}<NAME>) > this file > default. `mlx-kvserve config show` prints the",
        "# effective values and where each one came from.",
        "",
    ]
    tables = [f for f in fields if f.metadata.get("file_only")]
    for f in [f for f in fields if f not in tables]:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = str(f.metadata.get("help", "")).replace("%%", "%")
        out += textwrap.wrap(help_text, 98, initial_indent="# ", subsequent_indent="# ")
        if default is None or (default == [] and f.name in _EXAMPLES):
            example = _EXAMPLES.get(f.name, "")
            out.append(f"# {f.name} = {toml_value(example)}    (example; unset by default)")
        else:
            out.append(f"# {f.name} = {toml_value(default)}")
        out.append("")
    for f in tables:  # TOML tables come after the top-level keys
        help_text = str(f.metadata.get("help", "")).replace("%%", "%")
        out += textwrap.wrap(help_text, 98, initial_indent="# ", subsequent_indent="# ")
        out += [f"# {line}" for line in _TABLE_EXAMPLES.get(f.name, [])] + [""]
    return "\n".join(out)


_TABLE_EXAMPLES = {
    "models": [
        "[[models]]",
        '  name = "haiku"',
        '  model = "mlx-community/Qwen3-4B-Instruct-2507-4bit"',
        '  aliases = ["claude-haiku-4-5"]',
        '  keep_alive = "5m"',
        "  pinned = false",
    ]
}


def write_private(path: Path, text: str, *, overwrite: bool) -> None:
    """Write `text` to `path` as 0600 in a 0700 directory (config may hold an API key),
    durably (mlx_kvserve.durable); FileExistsError when it exists and `overwrite` is false."""
    paths.ensure_private(path.parent)
    data = text.encode("utf-8")
    if overwrite:
        durable.replace_file(path, data, 0o600)
    elif not durable.create_file(path, data, 0o600):
        raise FileExistsError(errno.EEXIST, "file exists", str(path))
