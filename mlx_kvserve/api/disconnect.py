"""Noticing at once that a client has gone while its non-streaming request runs.

Polling `request.is_disconnected()` between events only works when no event arrives for a while;
while tokens flow every few tens of milliseconds a departed client went unnoticed until the end,
so an abandoned request could hold the only engine for minutes. Instead a task waits on the ASGI
`receive` channel, which yields `http.disconnect` the moment the server sees the socket close,
and cancels the engine request right then: the engine stops within one decode step.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from starlette.requests import Request


class Cancellable(Protocol):
    """A piece of work the client's departure cancels: an engine request, an embedding job."""

    def cancel(self) -> None: ...


class DisconnectWatch:
    """Cancels `req` as soon as the client disconnects, until `close()`.

    Start it only after the body has been read: from then on the receive channel carries
    nothing but the disconnect.
    """

    def __init__(self, request: Request, req: Cancellable) -> None:
        self.gone = asyncio.Event()
        self._task = asyncio.create_task(self._watch(request, req))

    async def _watch(self, request: Request, req: Cancellable) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                req.cancel()
                self.gone.set()
                return

    def close(self) -> None:
        self._task.cancel()
