"""The Starlette application: routes, auth, and errors in the OpenAI shape."""

from __future__ import annotations

import asyncio
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
from mlx_kvserve.api import anthropic
from mlx_kvserve.api.auth import BearerAuth
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.failsafe import InternalErrors
from mlx_kvserve.api.generation import served_model
from mlx_kvserve.api.guard import BrowserGuard
from mlx_kvserve.api.openai_chat import chat_completions
from mlx_kvserve.api.openai_responses import responses
from mlx_kvserve.api.openai_text import completions
from mlx_kvserve.api.seal import make_reasoning_seal
from mlx_kvserve.chat import InvalidRequest
from mlx_kvserve.config import Settings
from mlx_kvserve.engine import Engine
from mlx_kvserve.engine.namespaces import cache_for, current_namespace
from mlx_kvserve.engine.worker import EngineNotReady
from mlx_kvserve.observe import Metrics
from mlx_kvserve.observe.http import RequestMetrics, metrics_endpoint

log = logging.getLogger("mlx_kvserve.api")


async def health(request: Request) -> Response:
    state = request.app.state
    engine: Engine = state.engine
    if not engine.ready.is_set():
        status = "error" if engine.load_error else "loading"
        body = {"status": status, "model": state.model_id, "version": __version__}
        if engine.load_error:
            body["error"] = engine.load_error
        return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})
    return JSONResponse(
        {
            "status": "ok",
            "model": state.model_id,
            "version": __version__,
            "queued": engine.queued,
            "running": engine.running,
            "paused": engine.paused,
            # as the engine last counted it (engine/admission.py); /v1/cache reads it afresh
            "kv_memory": engine.room.last if engine.room is not None else None,
        }
    )


async def root(request: Request) -> Response:
    """A liveness answer at `/`, as Ollama and llama.cpp give one: Claude Code probes the base URL
    with `HEAD /` (no API key) before its first request."""
    return Response("mlx-kvserve is running\n", media_type="text/plain")


CACHE_STATS_TIMEOUT = 30.0


async def cache_stats(request: Request) -> Response:
    """Prompt-cache counters and entries (the server's own view, including hit rate) and MLX's
    memory figures. Read on the engine thread, which owns the cache and MLX: reading the cache
    applies the writer thread's finished work to it."""
    engine: Engine = request.app.state.engine
    cache = cache_for(engine.prompt_cache, current_namespace.get())

    def snapshot() -> dict:
        memory = engine.memory.stats()
        if engine.room is not None:
            memory["kv"] = engine.room.report()  # what admission counts, part by part
        if cache is None:
            return {"enabled": False, "memory": memory}
        return {
            "enabled": True,
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


def _model_card(request: Request, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "mlx-kvserve",
    }


async def list_models(request: Request) -> Response:
    """The served model's id, then its --served-model-name aliases."""
    state = request.app.state
    names = dict.fromkeys([state.model_id, *state.settings.model_aliases()])
    return JSONResponse({"object": "list", "data": [_model_card(request, n) for n in names]})


async def get_model(request: Request) -> Response:
    """Any name is served by the loaded model (404 only with --strict-model-names)."""
    wanted = request.path_params["model_id"]
    served_model(request, wanted)
    return JSONResponse(_model_card(request, wanted))


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


def create_app(settings: Settings, engine: Engine, model_id: str) -> Starlette:
    """Build the app; the engine thread starts with the app and stops with it."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            log.info("shutting down: stopping the engine")
            await engine.stop_async()

    metrics = Metrics(engine, cache_enabled=engine.cache_enabled)
    engine.add_observer(metrics.observe_request)
    routes = [
        Route("/", root, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/cache", cache_stats, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
        # The same endpoints without /v1, as mlx_lm.server and llama.cpp serve them.
        Route("/models", list_models, methods=["GET"]),
        Route("/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/responses", responses, methods=["POST"]),
        Route("/messages", anthropic.messages, methods=["POST"]),
        Route("/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
    ]
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
    app.state.engine = engine
    app.state.model_id = model_id
    app.state.started = int(time.time())
    app.state.reasoning_seal = make_reasoning_seal()
    return app
