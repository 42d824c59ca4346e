"""`mlx-kvserve config show|path|init`: the configuration, explained.

A setting can come from four places (flag > environment > config file > default), and a
background service reads its environment and file far from the terminal the user looks at.
`config show` answers "which value is in effect, and why" for every setting at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from mlx_kvserve import paths
from mlx_kvserve.config.file import default_config_text, write_private
from mlx_kvserve.config.flags import add_setting_flags, setting_flags
from mlx_kvserve.config.precedence import resolve_settings
from mlx_kvserve.config.settings import ENV_PREFIX, Settings
from mlx_kvserve.config.values import SettingValue

SECRET = {"api_key", "api_keys"}


def add_config_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = sub.add_parser(
        "config",
        help="show the effective settings, the config file's path, or write a commented one",
        description="Settings come from command-line flags, then MLX_KVSERVE_<NAME> environment "
        "variables, then the TOML config file, then the defaults. MLX_KVSERVE_CONFIG names "
        "another config file.",
    )
    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print every effective setting and where it came from",
        description="Print every setting's effective value and its source: flag, environment "
        "(the variable), file (the path and line) or default. Accepts the same flags as "
        "`serve`, to preview what they would change. API keys are shown as '(set)'.",
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_setting_flags(show)
    actions.add_parser(
        "path",
        help="print the config file's location",
        description="Print where the config file is read from (MLX_KVSERVE_CONFIG, else the "
        "per-user config directory), whether or not it exists.",
    )
    init = actions.add_parser(
        "init",
        help="write a config file with every setting commented out at its default",
        description="Write the config file with every setting, its help text and its default, "
        "all commented out. The file is created 0600 in a 0700 directory (it may hold an API "
        "key). An existing file is kept unless --force is given.",
    )
    init.add_argument("--force", action="store_true", help="overwrite an existing file")


def run_config_command(args: argparse.Namespace) -> int:
    action = args.config_command
    if action == "path":
        print(paths.config_file())
        return 0
    if action == "init":
        return _init(force=args.force)
    return _show(args)


def _init(*, force: bool) -> int:
    path = paths.config_file()
    text = default_config_text(list(dataclasses.fields(Settings)), ENV_PREFIX)
    try:
        write_private(path, text, overwrite=force)
    except FileExistsError:
        print(f"error: {path} exists; pass --force to overwrite it")
        return 1
    except OSError as exc:
        print(f"error: cannot write {path}: {exc.strerror or exc}")
        return 1
    print(f"wrote {path}")
    return 0


def _shown(name: str, value: SettingValue) -> SettingValue:
    if name in SECRET:
        if isinstance(value, list):
            return [f"(set, {len(value)})"] if value else []
        return "(set)" if value else None
    return value


def _show(args: argparse.Namespace) -> int:
    try:
        resolved = resolve_settings(setting_flags(args))
    except ValueError as exc:
        print(f"error: {exc}")
        return 1
    settings, sources = resolved.settings, resolved.sources
    rows = [
        (name, _shown(name, getattr(settings, name)), sources[name])
        for name in Settings.option_names()
    ]
    if args.json:
        payload = {
            "config_file": str(resolved.config_path),
            "config_file_exists": resolved.config_path.is_file(),
            "settings": {
                name: {"value": value, "source": src.kind, "where": src.detail or None}
                for name, value, src in rows
            },
        }
        print(json.dumps(payload, indent=2))
        return 0
    state = "" if resolved.config_path.is_file() else " (not present)"
    print(f"config file: {resolved.config_path}{state}")
    width = max(len(name) for name, _, _ in rows) + 2
    for name, value, src in rows:
        text = "none" if value is None else json.dumps(value) if isinstance(value, list) else value
        print(f"{name:<{width}}{str(text):<28} {src}")
    return 0
