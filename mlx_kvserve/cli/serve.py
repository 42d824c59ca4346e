"""`mlx-kvserve serve`: prepare BLAS, the model and the prompt cache, then run uvicorn."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from mlx_kvserve import paths
from mlx_kvserve.config import Settings, parse_size
from mlx_kvserve.startup import (
    api_keys,
    open_namespaced,
    open_or_degrade,
    startup_problem,
    uvicorn_options,
)

log = logging.getLogger("mlx_kvserve")


def cache_root(settings: Settings) -> Path:
    """--cache-dir / MLX_KVSERVE_CACHE_DIR / config, else the per-user cache directory."""
    if settings.cache_dir:
        return Path(settings.cache_dir).expanduser()  # created (private) only by a writer
    return paths.cache_dir(create=False)


def open_prompt_cache(
    settings: Settings, model_dir: Path, model_id: str, kv_dtype: str | None = None
):
    """The model's PromptCache, or None with --no-cache. Raises CacheLockedError if in use."""
    if settings.no_cache:
        return None
    from mlx_kvserve.cache import PromptCache
    from mlx_kvserve.models.fingerprint import fingerprint_model

    budget = parse_size(settings.cache_budget) if settings.cache_budget else None
    keys = api_keys(settings) if settings.isolate_cache else []
    share = max(1, len(keys))  # per-key caches split the budgets

    def open_cache(root: Path | None) -> PromptCache:
        return PromptCache(
            root,
            fingerprint_model(model_dir, model_id, kv_dtype),
            disk_budget=budget // share if budget else None,
            ram_budget=parse_size(settings.cache_ram_budget) // share,
        )

    if keys:
        caches = open_namespaced(open_cache, cache_root(settings), keys)
        log.info("prompt cache: isolated per API key (%d namespaces)", len(keys))
        return caches
    cache = open_or_degrade(open_cache, cache_root(settings))
    stats = cache.stats()
    log.info(
        "prompt cache: %s entries, %s tokens, %.1f MiB on disk (budget %.1f GiB), index rebuilt in "
        "%.3f s%s",
        stats.get("entries"),
        stats.get("tokens"),
        stats.get("disk_bytes", 0) / 2**20,
        cache.disk_budget / 2**30,
        cache.rebuild_seconds,
        "; the last run ended uncleanly: its entries are verified at first use"
        if cache.unclean_start
        else "",
    )
    return cache


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn.Server that tells the engine to drain as soon as shutdown begins."""

        def __init__(self, config, engine, grace: float) -> None:
            super().__init__(config)
            self.engine, self.grace = engine, grace

        async def shutdown(self, sockets=None) -> None:
            log.info("shutting down: in-flight requests get %.0f s to finish", self.grace)
            self.engine.drain(self.grace)
            await super().shutdown(sockets)

    return DrainingServer


def _stop_before_serving(signum: int, _frame: object) -> None:
    """SIGTERM while the model is still being prepared: exit 0, as a service manager's stop
    expects (launchd's KeepAlive and systemd's Restart=on-failure restart unclean exits)."""
    log.info("stopped by signal %d before serving", signum)
    raise SystemExit(0)


def serve(settings: Settings) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit code."""
    from mlx_kvserve.blas import preload_optimised_blas

    signal.signal(signal.SIGTERM, _stop_before_serving)  # uvicorn takes over once it runs

    problem = startup_problem(settings)
    if problem:
        log.error("%s", problem)
        return 2

    blas = preload_optimised_blas(settings.blas_threads)  # must precede the first `import mlx`
    if blas:
        log.info("BLAS: %s", blas)

    from mlx_kvserve.net.resources import keep_open_file_limits

    with keep_open_file_limits():  # mlx_lm's import would lower the limit (or fail on it)
        import uvicorn
        from mlx_lm import load as mlx_load
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # we check context length ourselves, with a clear 400

    from mlx_kvserve.api.app import create_app
    from mlx_kvserve.cache import CacheLockedError
    from mlx_kvserve.chat.tool_format import tool_format_notice
    from mlx_kvserve.engine import Engine
    from mlx_kvserve.models.resolve import local_model_dir, resolve_model

    try:
        model_id, model_ref = resolve_model(settings.model, paths.data_dir(), progress=True)
        model_dir = local_model_dir(model_ref)
    except (ValueError, RuntimeError, OSError) as exc:
        log.error("cannot prepare the model: %s", exc)
        return 2
    from mlx_kvserve.models.preflight import model_dir_problem

    problem = model_dir_problem(model_dir)
    if problem:
        log.error("cannot serve the model: %s", problem)
        return 2
    from mlx_kvserve.models.context import read_context_length
    from mlx_kvserve.models.precision import (
        apply_kv_dtype,
        on_metal,
        resolve_kv_dtype,
        served_dtype,
    )

    kv_dtype = resolve_kv_dtype(settings.kv_dtype, metal=on_metal())

    def load_model():
        model, tokenizer = mlx_load(str(model_dir))
        log.info("%s", tool_format_notice(tokenizer))
        cast = apply_kv_dtype(model, kv_dtype, only_if_float32=settings.kv_dtype == "auto")
        if cast:
            log.info("serving the model's activations and KV cache in %s", kv_dtype)
        used = served_dtype(settings.kv_dtype, kv_dtype, cast)
        if used != kv_dtype and engine.prompt_cache is not None:
            # "auto" left the model in its own dtype: its cache is the one named for that dtype
            engine.prompt_cache.close()
            engine.prompt_cache = open_prompt_cache(settings, model_dir, model_id, used)
        return model, tokenizer

    try:
        prompt_cache = open_prompt_cache(settings, model_dir, model_id, kv_dtype)
    except CacheLockedError as exc:
        log.error("%s", exc)
        return 2

    engine = Engine(
        load_model,
        prompt_cache=prompt_cache,
        cache_enabled=not settings.no_cache,
        prefill_step=settings.prefill_step,
        checkpoint_interval=settings.checkpoint_interval,
        mlx_cache_limit=parse_size(settings.mlx_cache_limit),
        max_queue=settings.max_queue,
        max_concurrency=settings.max_concurrency,
        kv_budget=None if settings.kv_budget == "auto" else parse_size(settings.kv_budget),
        live_budget=parse_size(settings.live_budget),
        kv_reserve=settings.kv_reserve,
        context_length=read_context_length(model_dir),
    )
    app = create_app(settings, engine, model_id)
    DrainingServer = _draining_server_class()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # The engine ends in-flight streams after shutdown_grace; this is only a backstop.
        timeout_graceful_shutdown=settings.shutdown_grace + 5,
        log_config=None,
        **uvicorn_options(settings),  # connection cap, header/idle timeouts, open-file limit
    )
    # uvicorn handles SIGINT/SIGTERM while it runs (graceful shutdown), then re-raises the signal
    # into the handlers it found. Finding no-op handlers there lets a graceful stop exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        DrainingServer(config, engine, settings.shutdown_grace).run()
    finally:
        if engine.prompt_cache is not None:  # the one the engine used (see load_model)
            engine.prompt_cache.close()  # idempotent: flushes pending writes, clean-exit mark
    log.info(
        "stopped cleanly%s",
        ": checkpoint writes flushed, clean shutdown recorded" if prompt_cache is not None else "",
    )
    exit_now(0)
    return 0  # not reached


def exit_now(code: int) -> None:
    """End the process without interpreter finalization. Everything that matters is done (the
    engine thread joined, checkpoint writes flushed, the clean-shutdown mark written); what is
    left is native teardown (MLX's stream threads, OpenBLAS's pool), which can abort (SIGABRT)
    when its static destructors race, turning a clean stop into a crash for launchd/systemd."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
