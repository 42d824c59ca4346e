"""Optional API keys, as a plain ASGI middleware so streaming is untouched.

Keys come as `Authorization: Bearer <key>` (the scheme is case-insensitive, RFC 9110) or as
`x-api-key: <key>` (the Anthropic SDK's header). Several keys may be configured; the one that
matched names the request's cache namespace when per-key cache isolation is on.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.engine.namespaces import current_namespace, namespace_of


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key a client sent, from `Authorization: Bearer` or `x-api-key`; None if neither."""
    found: bytes | None = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            found = found or b""  # some other scheme: a key was sent, and it is wrong
        elif name == b"x-api-key" and value.strip():
            found = value.strip()
    return found


OPEN_PATHS = frozenset({"/health", "/"})


class BearerAuth:
    """Guard every path but the probes (/health, and `/`, which says only that the server runs)
    and `open_paths` (files that hold no data, e.g. the status page's) with one of the
    configured keys."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: Iterable[str] = (),
        *,
        isolate: bool = False,
        open_paths: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.open_paths = OPEN_PATHS | frozenset(open_paths)
        self.keys = [(key.encode(), namespace_of(key)) for key in dict.fromkeys(api_keys) if key]
        self.isolate = isolate

    def match(self, given: bytes) -> str | None:
        """The namespace of the matching key; every key is compared, in constant time each."""
        matched = None
        for key, namespace in self.keys:
            if hmac.compare_digest(given, key):
                matched = namespace
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.keys or scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = presented_key(scope["headers"])
        namespace = self.match(given) if given else None
        if namespace is None:
            message = (
                "Incorrect API key provided."
                if given is not None
                else "Missing API key: send 'Authorization: Bearer <key>'."
            )
            error = APIError(401, message, code="invalid_api_key")
            error.headers["WWW-Authenticate"] = "Bearer"
            await error.response(scope["path"])(scope, receive, send)
            return
        token = current_namespace.set(namespace if self.isolate else None)
        try:
            await self.app(scope, receive, send)
        finally:
            current_namespace.reset(token)
