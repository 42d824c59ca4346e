"""Optional bearer-key check, as a plain ASGI middleware so streaming is untouched."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_kvserve.api.errors import APIError


class BearerAuth:
    """Guard every path but /health with `Authorization: Bearer <key>` (/health is for probes)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected and scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            if b"x-api-key" in headers and not given:  # the Anthropic SDK's header
                given = b"Bearer " + headers[b"x-api-key"].strip()
            if not hmac.compare_digest(given, self.expected):
                message = (
                    "Incorrect API key provided."
                    if given
                    else "Missing API key: send 'Authorization: Bearer <key>'."
                )
                error = APIError(401, message, code="invalid_api_key")
                error.headers["WWW-Authenticate"] = "Bearer"
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
