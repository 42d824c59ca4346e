"""The `serve` setting flags, shared by `serve`, `config show`, `service install` and `service
status` (which reads the installed service's command line): outside `cli`, so `service` needs no
part of the command line package."""

from __future__ import annotations

import argparse
import dataclasses

from mlx_kvserve.config.setting_types import setting_type
from mlx_kvserve.config.settings import ENV_PREFIX, Settings
from mlx_kvserve.config.values import SettingValue

# What argparse turns a flag's text into, by the setting's type (switches and lists aside).
_PARSE: dict[object, type] = {int: int, float: float, str: str, str | None: str}


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, with its help, environment variable and default."""
    for f in dataclasses.fields(Settings):
        if f.metadata.get("file_only"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = "embedded SmolLM2-135M-Instruct" if f.name == "model" else f.default
        default_text = "none" if default is None else default
        kind = setting_type(f.name)
        if kind is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action="store_true",
                default=None,
                help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}=1]",
            )
            continue
        if kind == list[str]:  # repeatable; each value may also hold a, b, c
            parser.add_argument(
                flag,
                dest=f.name,
                action="append",
                default=None,
                metavar=f.name.upper().removesuffix("S"),
                help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}=a,b]",
            )
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=_PARSE[kind],
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}; default {default_text}]",
        )


def setting_flags(args: argparse.Namespace) -> dict[str, SettingValue]:
    """The setting flags that were given (None for the rest)."""
    names = set(Settings.option_names())
    return {k: v for k, v in vars(args).items() if k in names}
