"""The last line of defence: an unexpected exception becomes one 500 in the OpenAI shape.

Starlette's own handler for `Exception` sends its response and then re-raises, so uvicorn logs a
second traceback and drops the keep-alive connection, and the client's next request on it is
reset. Here the exception is logged once and the response completes normally, so the connection
stays usable. If the response had already started (a stream), nothing valid can be appended: the
exception is logged and the connection closed, which is what the client must see.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_kvserve.api.errors import APIError

log = logging.getLogger("mlx_kvserve.api")


class InternalErrors:
    """Answer an unhandled exception with a 500 error body without re-raising it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if started:
                return  # uvicorn closes a connection whose response never completed
            error = APIError(
                500, "Internal server error; see the server log.", code="internal_error"
            )
            await error.response(scope["path"])(scope, receive, send)
