"""Browser defences for a server on loopback: Host allow-list, Origin check, JSON-only POSTs.

Any web page the user opens can reach a local server. Two attacks matter:

* DNS rebinding: a page on `evil.example` re-resolves its own name to 127.0.0.1 and then reads
  our answers as same-origin. The request still carries `Host: evil.example`, so only Host
  values that name this server are accepted: loopback names and addresses, the address the
  connection actually arrived at (IP literals cannot be rebound), and `--allowed-hosts`.
* Cross-site requests: a page may POST `text/plain` (or no Content-Type at all) without a CORS
  preflight. POST bodies must be `application/json`, which browsers only send cross-origin after
  a preflight, and any request carrying a foreign `Origin` is refused outright, so even a
  "simple" request never reaches the engine. CORS is answered only for `--allowed-origins`,
  echoing that configured origin, never an arbitrary one. One exception, for Ollama's own
  examples (`curl .../api/chat -d '{...}'` sends a form Content-Type): a POST to `/api/*`
  that carries none of the headers every current browser adds to a POST (`Origin`,
  `Sec-Fetch-*`) is read as JSON whatever its Content-Type says.

This is a raw ASGI middleware, outermost, so nothing (auth included) runs for refused requests
and streaming responses pass through untouched.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_kvserve.api.errors import APIError, is_ollama

log = logging.getLogger("mlx_kvserve.api")

LOOPBACK_NAMES = frozenset({"localhost"})
PREFLIGHT_MAX_AGE = "600"
ALLOWED_METHODS = "GET, POST, OPTIONS"


def split_host(value: str) -> tuple[str, int | None] | None:
    """'Name:port', '[v6]:port' or an IP literal -> (lower-case host, port); None if malformed."""
    value = value.strip()
    if not value or any(c in value for c in "/\\@?# \t"):
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1 :]
        if "%" in host:  # a zone id: link-local only, never this server's name
            return None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    else:
        if value.count(":") > 1:  # an unbracketed IPv6 literal is not a valid Host
            return None
        host, colon, port_text = value.partition(":")
        rest = colon + port_text
    port: int | None = None
    if rest:
        if not rest.startswith(":") or not rest[1:].isdigit() or len(rest) > 6:
            return None
        port = int(rest[1:])
        if not 0 < port < 65536:
            return None
    host = host.lower()
    if host.endswith(".") and not host.endswith(".."):
        host = host[:-1]  # "localhost." is the same name as "localhost"
    return (host, port) if host else None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def is_loopback(host: str) -> bool:
    addr = _ip(host)
    return host in LOOPBACK_NAMES if addr is None else addr.is_loopback


class HostPolicy:
    """Which Host header values name this server."""

    def __init__(self, allowed_hosts: Iterable[str]) -> None:
        self.any_port: set[str] = set()
        self.with_port: set[tuple[str, int]] = set()
        for item in allowed_hosts:
            parsed = split_host(item)
            if parsed is None:
                raise ValueError(f"setting 'allowed_hosts': {item!r} is not a host[:port]")
            host, port = parsed
            if port is None:
                self.any_port.add(host)
            else:
                self.with_port.add((host, port))

    def allows(self, host_header: str, server: tuple[str, int | None] | None) -> bool:
        parsed = split_host(host_header)
        if parsed is None:
            return False
        host, port = parsed
        if host in self.any_port or (port is not None and (host, port) in self.with_port):
            return True
        local_host, local_port = server if server else (None, None)
        if port is not None and local_port is not None and port != local_port:
            return False  # another port on this machine is another server
        if is_loopback(host):
            return True
        addr, local = _ip(host), _ip(local_host) if local_host else None
        return addr is not None and local is not None and addr == local


def normalise_origin(value: str) -> str | None:
    """'HTTP://Example.com:80' -> 'http://example.com'; None for 'null' or anything malformed."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in {"http", "https"} or not parts.hostname or parts.path not in {"", "/"}:
        return None
    if parts.query or parts.fragment or parts.username or parts.password:
        return None
    default = 80 if parts.scheme == "http" else 443
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + ("" if port in (None, default) else f":{port}")


class BrowserGuard:
    """Refuse foreign Host and Origin values and non-JSON POSTs; answer CORS for allowed origins."""

    def __init__(
        self, app: ASGIApp, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()
    ) -> None:
        self.app = app
        self.hosts = HostPolicy(allowed_hosts)
        self.origins: set[str] = set()
        for item in allowed_origins:
            origin = normalise_origin(item)
            if origin is None:
                raise ValueError(f"setting 'allowed_origins': {item!r} is not scheme://host[:port]")
            self.origins.add(origin)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            log.info("%s %s -> %d: %s", scope["method"], scope["path"], refusal.status, refusal)
            await refusal.response(scope["path"])(scope, receive, send)
            return
        origin = headers.get("origin")
        allowed = normalise_origin(origin) if origin is not None else None
        if allowed is not None and allowed not in self.origins:
            allowed = None  # same-origin: a browser needs no CORS headers for it
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(scope, receive, send, allowed, headers)
            return
        if allowed is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], *_cors_headers(allowed)]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        host = headers.get("host", "")
        if not self.hosts.allows(host, scope.get("server")):
            return APIError(
                403,
                f"Host {host!r} is not allowed: this server answers to loopback, its own "
                "address and --allowed-hosts (a guard against DNS rebinding).",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, host, scope):
            return APIError(
                403,
                f"Origin {origin!r} is not allowed; add it to --allowed-origins to let that web "
                "page use this server.",
                code="origin_not_allowed",
            )
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json" and not _ollama_non_browser(scope["path"], headers):
                return APIError(
                    415,
                    "POST bodies must be sent with 'Content-Type: application/json'.",
                    code="unsupported_media_type",
                )
        return None

    def _origin_ok(self, origin: str, host: str, scope: Scope) -> bool:
        normal = normalise_origin(origin)
        if normal is None:
            return False
        if normal in self.origins:
            return True
        # Same origin: the page was served by this very host:port (the Host already passed).
        scheme = scope.get("scheme", "http")
        parsed = split_host(host)
        if parsed is None:
            return False
        name, port = parsed
        if port is None and scope.get("server"):
            port = scope["server"][1]
        name = f"[{name}]" if ":" in name else name
        return normal == normalise_origin(f"{scheme}://{name}:{port}")

    async def _preflight(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        origin: str | None,
        headers: dict[str, str],
    ) -> None:
        if origin is None:  # same-origin pages never preflight; foreign ones were refused above
            error = APIError(403, "CORS is not enabled for this origin.", code="origin_not_allowed")
            await error.response(scope["path"])(scope, receive, send)
            return
        extra = [
            (b"access-control-allow-methods", ALLOWED_METHODS.encode()),
            (b"access-control-max-age", PREFLIGHT_MAX_AGE.encode()),
        ]
        wanted = headers.get("access-control-request-headers")
        if wanted:
            extra.append((b"access-control-allow-headers", wanted.encode("latin-1")))
        await send(
            {
                "type": "http.response.start",
                "status": 204,
                "headers": [*_cors_headers(origin), *extra],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def _headers(scope: Scope) -> dict[str, str]:
    """Header values by lower-case name; a repeated Host or Origin counts as malformed."""
    out: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        if name in out and name in {"host", "origin"}:
            value = ""  # two Host headers: refuse rather than guess which one a proxy used
        out[name] = value
    return out


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"vary", b"Origin"),
        (b"access-control-expose-headers", b"Retry-After"),
    ]


def _ollama_non_browser(path: str, headers: dict[str, str]) -> bool:
    """A non-browser client of Ollama's native API (curl as Ollama's docs show it, scripts):
    no `Origin` and no `Sec-Fetch-*` header, which browsers send with every POST."""
    browser = "origin" in headers or any(name.startswith("sec-fetch-") for name in headers)
    return is_ollama(path) and not browser
