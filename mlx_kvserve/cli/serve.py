"""`mlx-kvserve serve`: prepare BLAS, the model and the prompt cache, then run uvicorn."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.config.values import parse_size
from mlx_kvserve.startup import (
    api_keys,
    open_namespaced,
    open_or_degrade,
    startup_problem,
    uvicorn_options,
)

log = logging.getLogger("mlx_kvserve")


def open_prompt_cache(
    settings: Settings,
    model_dir: Path,
    model_id: str,
    kv_dtype: str | None = None,
    rank: str | None = None,
):
    """The model's PromptCache, or None with --no-cache. Raises CacheLockedError if in use.
    `rank` names this rank's slice in a job across machines (cli/serve_job.py)."""
    if settings.no_cache:
        return None
    from mlx_kvserve.cache import PromptCache
    from mlx_kvserve.models.identity import fingerprint_model

    budget = parse_size(settings.cache_budget) if settings.cache_budget else None
    keys = api_keys(settings) if settings.isolate_cache else []
    share = max(1, len(keys))  # per-key caches split the budgets

    def open_cache(root: Path | None) -> PromptCache:
        return PromptCache(
            root,
            fingerprint_model(model_dir, model_id, kv_dtype) + (f"-{rank}" if rank else ""),
            disk_budget=budget // share if budget else None,
            ram_budget=parse_size(settings.cache_ram_budget) // share,
        )

    if keys:
        caches = open_namespaced(open_cache, settings.cache_root(), keys)
        log.info("prompt cache: isolated per API key (%d namespaces)", len(keys))
        return caches
    cache = open_or_degrade(open_cache, settings.cache_root())
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
        """uvicorn.Server that tells the engines to drain as soon as shutdown begins."""

        def __init__(self, config, pool, grace: float) -> None:
            super().__init__(config)
            self.pool, self.grace = pool, grace

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if _stop_requested.is_set():  # a SIGTERM just before uvicorn took the signals over
                self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            log.info("shutting down: in-flight requests get %.0f s to finish", self.grace)
            self.pool.drain(self.grace)
            await super().shutdown(sockets)

    return DrainingServer


_stop_requested = threading.Event()  # a SIGTERM came before uvicorn took the signals over


def _stop_before_serving(signum: int, _frame: object) -> None:
    """SIGTERM while the model is still being prepared: exit 0, as a service manager's stop
    expects (launchd's KeepAlive and systemd's Restart=on-failure restart unclean exits).
    The SystemExit interrupts a long import; code that swallows it (some libraries' import
    guards catch everything) is caught up with by the checks `serve` makes between phases."""
    if not _stop_requested.is_set():
        log.info("stopped by signal %d before serving", signum)
    _stop_requested.set()
    raise SystemExit(0)


def serve(settings: Settings) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit code."""
    from mlx_kvserve.blas import preload_optimised_blas

    signal.signal(signal.SIGTERM, _stop_before_serving)  # uvicorn takes over once it runs

    problem = startup_problem(settings)
    if problem:
        log.error("%s", problem)
        return 2
    if settings.hostfile and not in_job():
        from mlx_kvserve.distributed.launcher import run_job

        argv = sys.argv[sys.argv.index("serve") + 1 :] if "serve" in sys.argv else []
        return run_job(settings.hostfile, settings.ring_port, settings.shutdown_grace, argv)

    blas = preload_optimised_blas(settings.blas_threads)  # must precede the first `import mlx`
    if blas:
        log.info("BLAS: %s", blas)

    from mlx_kvserve.net.resources import keep_open_file_limits

    with keep_open_file_limits():  # mlx_lm's import would lower the limit (or fail on it)
        import uvicorn  # noqa: F401  (its import, too, under the file-limit guard)
        from mlx_lm import load as mlx_load
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # we check context length ourselves, with a clear 400

    if _stop_requested.is_set():
        return 0
    if in_job():
        from mlx_kvserve.cli.serve_job import ServeParts, serve_job
        from mlx_kvserve.distributed.collective import Collective

        collective = Collective.join(timeout=settings.peer_timeout)
        if collective.distributed:
            parts = ServeParts(open_prompt_cache, run_http, exit_now)
            return serve_job(settings, collective, parts)
    from mlx_kvserve.cache import CacheLockedError
    from mlx_kvserve.models.pool import ModelPool
    from mlx_kvserve.models.serving import ModelSetupError, prepare_slots

    try:
        slots, start_engine = prepare_slots(settings, open_prompt_cache, mlx_load)
        premade = {slots[0].name: start_engine(slots[0])}  # the default's cache opens now
    except ModelSetupError as exc:
        log.error("%s", exc)
        return 2
    except CacheLockedError as exc:
        log.error("%s", exc)
        return 2

    def engine_for(slot):
        engine = premade.pop(slot.name, None)
        return engine if engine is not None else start_engine(slot)

    from mlx_kvserve.models.budget import memory_budget

    budget = memory_budget(settings.memory_budget)
    from mlx_kvserve.models.specs import parse_duration

    pool = ModelPool(
        slots,
        engine_for,
        memory_budget=budget,
        max_loaded=settings.max_loaded_models,
        keep_alive=parse_duration(settings.keep_alive),
    )
    pool.adopt = start_engine.adopt  # Ollama's /api/pull, when --allow-pull lets it
    if len(slots) > 1:
        log.info(
            "models: %s (default %s; others load on first use; at most %d loaded, %.1f GiB)",
            ", ".join(slot.name for slot in slots),
            slots[0].name,
            pool.max_loaded,
            budget / 2**30,
        )
    if _stop_requested.is_set():
        for engine in premade.values():  # never started: close its cache
            if engine.prompt_cache is not None:
                engine.prompt_cache.close()
        return 0
    try:
        run_http(settings, pool)
    finally:
        for engine in premade.values():  # never started: close its cache
            if engine.prompt_cache is not None:
                engine.prompt_cache.close()
    exit_now(0)
    return 0  # not reached


def in_job() -> bool:
    """Started by `mlx.launch` (or MPI) as one rank of a job."""
    return any(name in os.environ for name in ("MLX_RANK", "OMPI_COMM_WORLD_SIZE"))


def run_http(settings: Settings, pool) -> None:
    """Serve `pool`'s models over HTTP until SIGINT/SIGTERM, then drain."""
    import uvicorn

    from mlx_kvserve.api.app import create_app

    if _stop_requested.is_set():
        return
    app = create_app(settings, pool)
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
    # into the handlers it found. Finding handlers that only note the stop lets a graceful stop
    # exit 0, and a stop that comes just before uvicorn takes over ends it at start-up.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: _stop_requested.set())
    DrainingServer(config, pool, settings.shutdown_grace).run()
    log.info(
        "stopped cleanly%s",
        "" if settings.no_cache else ": checkpoint writes flushed, clean shutdown recorded",
    )


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
