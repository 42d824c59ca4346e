"""Noticing at once that a client has gone while its non-streaming request runs.

Polling `request.is_disconnected()` between events only works when no event arrives for a while;
while tokens flow every few tens of milliseconds a departed client went unnoticed until the end,
so an abandoned request could hold the only engine for minutes. Instead a task waits on the ASGI
`receive` channel, which yields `http.disconnect` the moment the server sees the socket close,
and cancels the engine request right then: the engine stops within one decode step.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Protocol, TypeVar

from starlette.requests import Request

T = TypeVar("T")


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


async def unless_gone(request: Request, work: Cancellable, done: Future[T]) -> T | None:
    """`done`'s result (its exception raised), or None if the client leaves first (`work` is
    cancelled then). Cancelling the caller cancels `work` too."""
    watch = DisconnectWatch(request, work)
    try:
        result = asyncio.wrap_future(done)
        gone = asyncio.create_task(watch.gone.wait())
        await asyncio.wait([result, gone], return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not result.done():
            result.cancel()
            return None
        return result.result()
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.close()
