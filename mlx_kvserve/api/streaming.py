"""Turning engine events into an SSE stream or a single JSON body.

Keep-alive comments go out while the engine has not produced anything yet (a long prefill), so
clients with read timeouts stay connected. Leaving the stream early (client gone) cancels the
request, which the engine notices within one decode step or prefill chunk.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from mlx_kvserve.api.disconnect import DisconnectWatch
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.responses import Shape
from mlx_kvserve.engine import Done, EngineError, GenerationRequest, TextChunk

DISCONNECT_POLL_SECONDS = 0.5


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _interrupted(done: Done | EngineError) -> dict[str, Any]:
    message = (
        done.message
        if isinstance(done, EngineError)
        else "generation was cancelled: the server is shutting down"
    )
    return APIError(503 if isinstance(done, Done) else 500, message).body()


async def sse_events(
    req: GenerationRequest, shape: Shape, *, include_usage: bool, keepalive: float
) -> AsyncIterator[str]:
    try:
        if shape.kind == "chat":
            yield _sse(shape.chunk("", first=True))
        while True:
            event = await req.next_event(timeout=keepalive)
            if event is None:
                yield ": keep-alive\n\n"
            elif isinstance(event, TextChunk):
                yield _sse(shape.chunk(event.text))
            elif isinstance(event, Done) and event.finish_reason != "cancelled":
                yield _sse(shape.chunk(None, event.finish_reason))
                if include_usage:
                    yield _sse(shape.usage_chunk(event))
                yield "data: [DONE]\n\n"
                return
            else:
                yield _sse(_interrupted(event))
                yield "data: [DONE]\n\n"
                return
    finally:
        req.cancel()  # no-op when finished; stops the engine when the client left early


async def collect(req: GenerationRequest, request: Request) -> tuple[str, Done]:
    """Wait for the whole completion, cancelling it if the client disconnects meanwhile."""
    parts: list[str] = []
    watch = DisconnectWatch(request, req)  # cancels req the moment the client goes
    try:
        while True:
            event = await req.next_event(timeout=DISCONNECT_POLL_SECONDS)
            if watch.gone.is_set():
                raise APIError(499, "client disconnected")
            if event is None:
                continue
            elif isinstance(event, TextChunk):
                parts.append(event.text)
            elif isinstance(event, Done) and event.finish_reason != "cancelled":
                return "".join(parts), event
            elif isinstance(event, Done):
                raise APIError(503, "generation was cancelled: the server is shutting down")
            else:
                raise APIError(500, event.message, code="engine_error")
    finally:
        watch.close()
        req.cancel()
