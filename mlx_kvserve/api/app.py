"""The Starlette application: routes, auth, and errors in the OpenAI shape."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_kvserve import __version__
from mlx_kvserve.api import (
    anthropic,
    model_admin,
    ollama,
    ollama_embed,
    ollama_generate,
    ollama_pull,
    status,
    tokenize,
)
from mlx_kvserve.api.auth import BearerAuth
from mlx_kvserve.api.engine_view import EngineView
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.failsafe import InternalErrors
from mlx_kvserve.api.generation import served_model
from mlx_kvserve.api.guard import BrowserGuard
from mlx_kvserve.api.images import make_image_reader
from mlx_kvserve.api.openai_chat import chat_completions
from mlx_kvserve.api.openai_embeddings import embeddings
from mlx_kvserve.api.openai_responses import responses
from mlx_kvserve.api.openai_text import completions
from mlx_kvserve.api.seal import make_reasoning_seal
from mlx_kvserve.chat import InvalidRequest
from mlx_kvserve.chat.reasoning.sampled_turns import SampledTurns
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.embed.kind import kind_of
from mlx_kvserve.engine import EngineNotReady
from mlx_kvserve.engine.namespaces import cache_for, caches_of, current_namespace
from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.pool import LOADED, ModelPool, Slot
from mlx_kvserve.models.pressure import GAUGE, pressure_source
from mlx_kvserve.models.pressure_watch import PressureWatch
from mlx_kvserve.observe import Metrics
from mlx_kvserve.observe.activity import Activity
from mlx_kvserve.observe.http import RequestMetrics, metrics_endpoint

log = logging.getLogger("mlx_kvserve.api")


async def health(request: Request) -> Response:
    """503 until the default model has loaded once (or when its last load failed, or its
    engine stopped after a failure it could not recover from), then 200 with every model's
    state, the requests queued, running and paused, the KV memory, and the prompt cache's disk
    (`cache_disk`: writes failing and why, a budget lowered for want of space; the server still
    serves, from RAM). A model unloaded for idleness or memory still serves, loading again on
    the next request. Every configured model is listed with its state ("loading", "loaded",
    "unloaded")."""
    state = request.app.state
    pool: ModelPool = state.pool
    default = pool.default
    engine: EngineView | None = default.engine
    body: dict[str, JSON] = {"model": default.name, "version": __version__, "models": _states(pool)}
    if state.pressure is not None:
        body["memory_pressure"] = state.pressure.level
    if engine is not None and engine.cluster is not None:
        body["cluster"] = engine.cluster  # every rank steps each turn with rank 0
    ready = engine is not None and engine.ready.is_set()
    error = (engine.load_error or engine.failure if engine is not None else None) or default.error
    if error or not (ready or default.loaded_at):
        body = {"status": "error" if error else "loading", **body}
        if error:
            body["error"] = error
        return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})
    engines = pool.engines()
    return JSONResponse(
        {
            "status": "ok",
            **body,
            "queued": sum(e.queued for e in engines),
            "running": sum(e.running for e in engines),
            "paused": sum(e.paused for e in engines),
            # as the default model's engine last counted it (engine/ledger.py); /v1/cache
            # reads it afresh
            "kv_memory": engine.room.last if ready and engine.room is not None else None,
            "cache_disk": _cache_disk(engines),
        }
    )


def _cache_disk(engines: list[EngineView]) -> dict[str, JSON] | None:
    """The prompt caches' disk tier: a failing or full disk leaves the server serving (from
    RAM), so /health stays 200 and says so here. None without a disk tier."""
    states = [
        state
        for engine in engines
        for cache in caches_of(engine.prompt_cache)
        if (state := cache.disk_state()) is not None
    ]
    if not states:
        return None
    failing = [state for state in states if state["writes_failing"]]
    return {
        "writes_failing": bool(failing),
        "error": failing[0]["error"] if failing else None,
        "budget_lowered": any(state["budget_lowered"] for state in states),
        "undeleted_files": sum(state["undeleted_files"] for state in states),
    }


def _states(pool: ModelPool) -> dict[str, str]:
    return {slot.name: slot.state for slot in pool.slots}


CACHE_STATS_TIMEOUT = 30.0


async def cache_stats(request: Request) -> Response:
    """Prompt-cache counters and entries (the server's own view, including hit rate) and MLX's
    memory figures, of the default model or of `?model=NAME`.

    Read on the model's engine thread, which owns its cache and MLX: reading the cache applies
    the writer thread's finished work to it."""
    pool: ModelPool = request.app.state.pool
    wanted = request.query_params.get("model")
    slot = pool.find(wanted)
    if slot is None:
        raise APIError(404, f"The model {wanted!r} does not exist.", param="model")
    engine: EngineView | None = slot.engine
    if engine is None:
        raise APIError(503, f"The model {slot.name!r} is not loaded.", headers={"Retry-After": "2"})
    cache = cache_for(engine.prompt_cache, current_namespace.get())

    def snapshot() -> dict[str, JSON]:
        memory: dict[str, JSON] = dict(engine.memory.stats())
        if engine.room is not None:
            memory["kv"] = engine.room.report()  # what admission counts, part by part
        if cache is None:
            return {"enabled": False, "model": slot.name, "memory": memory}
        return {
            "enabled": True,
            "model": slot.name,
            **cache.stats(),
            "memory": memory,
            "entries_list": [e.as_dict() for e in cache.entries()],
        }

    try:
        pending = asyncio.wrap_future(engine.call(snapshot))
        body = await asyncio.wait_for(pending, CACHE_STATS_TIMEOUT)
    except EngineNotReady as exc:
        raise APIError(503, str(exc), headers={"Retry-After": "2"}) from None
    except TimeoutError:
        raise APIError(503, "the engine is busy", headers={"Retry-After": "2"}) from None
    return JSONResponse(body)


def _model_card(request: Request, name: str, slot: Slot) -> dict[str, JSON]:
    return {
        "id": name,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "mlx-kvserve",
        "loaded": slot.state == LOADED,
        "state": slot.state,
        "model": slot.name,  # the model an alias stands for
        "capabilities": _capabilities(slot),
    }


def _capabilities(slot: Slot) -> list[JSON]:
    """What the model is for (embed/kind.py; a generative model embeds too, by mean pooling),
    and `vision` when it sees images (`Slot.sees_images`)."""
    if kind_of(slot.model_dir).embedding_model:
        return ["embedding"]
    return ["completion", *(["vision"] if slot.sees_images else [])]


async def list_models(request: Request) -> Response:
    """Every configured model, then its aliases, each with whether it is loaded."""
    pool: ModelPool = request.app.state.pool
    data = [_model_card(request, name, slot) for slot in pool.slots for name in slot.names]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    """One model card. Any name is served by the default model (404 only with
    --strict-model-names)."""
    wanted = request.path_params["model_id"]
    return JSONResponse(_model_card(request, wanted, served_model(request, wanted)))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    log.info(
        "%s %s -> %d %s: %s",
        request.method,
        request.url.path,
        exc.status,
        exc.code or "-",
        exc.message,
    )
    return exc.response(request.url.path)


async def _invalid_request(request: Request, exc: Exception) -> Response:
    """The chat layer's InvalidRequest, wherever an adapter let it out: a 400 in the protocol's
    shape, never a 500."""
    assert isinstance(exc, InvalidRequest)
    return await _api_error(request, APIError(400, exc.message, param=exc.param, code=exc.code))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"Unknown path: {request.url.path}", 405: "Method not allowed."}.get(
        exc.status_code, str(exc.detail)
    )
    return APIError(exc.status_code, message, headers=exc.headers).response(request.url.path)


def api_routes() -> list[Route]:
    """Every route of the API, in matching order (docs/reference/endpoints.md is made from
    this list and each endpoint's docstring)."""
    return [
        # `/`: "Ollama is running" (also Claude Code's `HEAD /` probe), or for a browser the
        # status page; then the page's files and its data.
        Route("/", ollama.root, methods=["GET"]),
        *(Route(path, status.page, methods=["GET"]) for path in status.ASSETS if path != "/"),
        Route("/v1/status", status.status, methods=["GET"]),
        Route("/v1/status/events", status.status_events, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/cache", cache_stats, methods=["GET"]),
        Route("/v1/models/{model_id:path}/unload", model_admin.unload_model, methods=["POST"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/api/ps", model_admin.loaded_models, methods=["GET"]),
        # Ollama's native API (api/ollama.py)
        Route("/api/version", ollama.version, methods=["GET"]),
        Route("/api/tags", ollama.tags, methods=["GET"]),
        Route("/api/show", ollama.show, methods=["POST"]),
        Route("/api/chat", ollama.chat, methods=["POST"]),
        Route("/api/generate", ollama_generate.generate, methods=["POST"]),
        Route("/api/embed", ollama_embed.embed_endpoint, methods=["POST"]),
        Route("/api/embeddings", ollama_embed.embeddings_endpoint, methods=["POST"]),
        Route("/api/pull", ollama_pull.pull, methods=["POST"]),
        Route("/api/create", ollama.not_supported, methods=["POST"]),
        Route("/api/copy", ollama.not_supported, methods=["POST"]),
        Route("/api/push", ollama.not_supported, methods=["POST"]),
        Route("/api/delete", ollama.not_supported, methods=["DELETE"]),
        Route("/api/blobs/{digest}", ollama.not_supported, methods=["HEAD", "POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
        # The tokenizer, as vLLM serves it (evaluation harnesses: api/tokenize.py)
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenize.tokenizer_info, methods=["GET"]),
        # The same endpoints without /v1, as mlx_lm.server and llama.cpp serve them.
        Route("/models", list_models, methods=["GET"]),
        Route("/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/embeddings", embeddings, methods=["POST"]),
        Route("/responses", responses, methods=["POST"]),
        Route("/messages", anthropic.messages, methods=["POST"]),
        Route("/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
    ]


def create_app(settings: Settings, pool: ModelPool) -> Starlette:
    """Build the app; the default model starts loading with the app, the others when a request
    first names them; every engine stops with the app."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        preload = asyncio.create_task(_preload(pool))
        tasks = [preload, asyncio.create_task(pool.run_reaper())]
        if pressure is not None:
            tasks.append(asyncio.create_task(pressure.run()))
        try:
            yield
        finally:
            log.info("shutting down: stopping the engines")
            for task in tasks:
                task.cancel()
            await pool.close()

    metrics = Metrics(pool.engines, cache_enabled=not settings.no_cache)
    activity = Activity()

    def observe(slot: Slot, engine: EngineView) -> None:
        engine.add_observer(metrics.observe_request)
        engine.add_observer(functools.partial(activity.record, slot.name))

    pressure = _pressure_watch(settings, pool, metrics)
    pool.on_engine.append(observe)
    pool.on_loaded.append(lambda slot: metrics.loads.labels(slot.name).inc())
    pool.on_unloaded.append(lambda slot, kind: metrics.unloads.labels(slot.name, kind).inc())
    routes = api_routes()
    app = Starlette(
        routes=routes,
        middleware=[
            # Outermost: every response is counted, the guard's and auth's refusals included.
            Middleware(RequestMetrics, metrics=metrics, routes=routes),
            Middleware(InternalErrors),  # an unexpected exception: one 500, connection kept
            Middleware(
                BrowserGuard,
                allowed_hosts=settings.allowed_hosts,
                allowed_origins=settings.allowed_origins,
            ),
            Middleware(
                BearerAuth,
                api_keys=[settings.api_key or "", *settings.api_keys],
                isolate=settings.isolate_cache,
                open_paths=status.OPEN_PATHS,
            ),
        ],
        exception_handlers={
            APIError: _api_error,
            InvalidRequest: _invalid_request,
            HTTPException: _http_error,
        },
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.activity = activity
    app.state.pool = pool
    app.state.pressure = pressure
    app.state.started = int(time.time())
    app.state.reasoning_seal = make_reasoning_seal()
    app.state.image_reader = make_image_reader(settings)  # api/images.py
    app.state.sampled_turns = SampledTurns()  # the tool-calling turns kept (api/generation.py)
    return app


def _pressure_watch(settings: Settings, pool: ModelPool, metrics: Metrics) -> PressureWatch | None:
    """The memory-pressure loop, unless turned off or the system cannot tell."""
    source = None if settings.no_pressure_watch else pressure_source()
    if source is None:
        return None
    return PressureWatch(
        pool,
        source,
        on_level=lambda level: metrics.pressure.set(GAUGE[level]),
        on_action=lambda action: metrics.pressure_actions.labels(action).inc(),
    )


async def _preload(pool: ModelPool) -> None:
    """Load the default model at start-up (health says 503 until it is ready)."""
    slot = pool.default
    try:
        await pool.acquire(slot)
    except Exception as exc:  # health reports it; a request retries the load
        log.error("the default model did not load: %s", exc)
        return
    pool.release(slot)
