"""The HTTP side of the metrics: a count of every response, and the `GET /metrics` endpoint.

Labels stay bounded whatever clients send: the route is the matched route's template (or
"unmatched"), never the raw path, and the status is the code the server chose.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_kvserve.engine.worker import EngineNotReady
from mlx_kvserve.observe.metrics import Metrics

MEMORY_READ_TIMEOUT = 2.0  # seconds; the engine runs calls between decode steps

# Generation routes by wire protocol (the /v1-less aliases map the same way).
PROTOCOLS = {
    "/v1/chat/completions": "openai_chat",
    "/v1/completions": "openai_text",
    "/v1/responses": "openai_responses",
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
}


def protocol_of(route: str) -> str:
    path = route if route.startswith("/v1/") else "/v1" + route
    return PROTOCOLS.get(path, "none")


class RequestMetrics:
    """Outermost ASGI middleware: counts every response, including the guard's 403s and the
    auth layer's 401s, by route, protocol and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list[Route]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def route_of(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:  # PARTIAL: the path matched but not the method (405)
                return route.path
        return "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = "disconnected"  # the client left before any response started

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if status == "disconnected":
                status = "500"
            raise
        finally:
            route = self.route_of(scope)
            self.metrics.requests.labels(route, protocol_of(route), status).inc()


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus metrics in the text format (docs/reference/metrics.md).

    Behind the API key when one is set, like every path but /health. MLX's memory is read on
    the engine thread, which owns MLX (a prefill chunk or decode step away at most); rendering
    runs off the event loop, as reading the cache's counters takes its lock."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    metrics: Metrics = request.app.state.metrics
    engines = request.app.state.pool.engines()
    with contextlib.suppress(EngineNotReady, TimeoutError):  # then the last figures stand
        if engines:  # MLX's figures are the process's: any loaded model's thread reads them
            engine = engines[0]
            read = engine.call(lambda: metrics.observe_memory(engine.memory.stats()))
            await asyncio.wait_for(asyncio.wrap_future(read), MEMORY_READ_TIMEOUT)
    body = await run_in_threadpool(generate_latest, metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
