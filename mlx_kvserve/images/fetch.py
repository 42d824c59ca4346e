"""Fetching an image URL, only where `--image-urls` allows it.

A URL in a request makes the server a client of someone else's network: off by default. When
allowed, every hop (the URL and each redirect) must be http(s), name a host on the allowlist,
and resolve only to public addresses; the connection goes to the very address that was checked
(no second DNS lookup an attacker could answer differently), under a byte cap and a deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from mlx_kvserve.images.pixels import ImageRefused

MAX_REDIRECTS = 5
CHUNK = 64 * 1024
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], list[str]]


def public(address: Address) -> bool:
    """Not private, loopback, link-local, shared, reserved, multicast or unspecified."""
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    return address.is_global and not address.is_multicast


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (all are checked; the first is used)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class Fetcher:
    """Fetches image URLs under the server's rules; `hosts` empty: URLs are refused.

    `trusted` is the test seam: (address, port) pairs treated as public, so a test's own server
    on loopback can answer while every other private address is still refused; `resolver` and
    `tls` (None: the system's certificate authorities) let a test name its HTTPS server.
    """

    hosts: Sequence[str] = ()
    max_bytes: int = 20 * 1024 * 1024
    timeout: float = 10.0
    trusted: frozenset[tuple[str, int]] = field(default_factory=frozenset)
    resolver: Resolve = resolve
    tls: ssl.SSLContext | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.hosts)

    def fetch(self, url: str) -> bytes:
        """The body at `url` after at most MAX_REDIRECTS redirects; ImageRefused says why not."""
        if not self.enabled:
            raise ImageRefused(
                "image URLs are off on this server (start it with --image-urls HOST to allow "
                "hosts); send the image inline as base64 or a data: URL"
            )
        deadline = time.monotonic() + self.timeout
        for _ in range(MAX_REDIRECTS + 1):
            try:
                status, location, body = self._hop(url, deadline)
            except ImageRefused:
                raise
            except ValueError as exc:  # a port out of range, a host IDNA cannot encode, ...
                raise ImageRefused(f"the image URL is not usable ({exc})") from None
            if location is None:
                if status != 200:
                    raise ImageRefused(f"fetching the image URL answered HTTP {status}")
                return body
            url = urljoin(url, location)
        raise ImageRefused(f"the image URL redirected more than {MAX_REDIRECTS} times")

    def _hop(self, url: str, deadline: float) -> tuple[int, str | None, bytes]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ImageRefused(f"an image URL must be http(s) with a host (got {url[:80]!r})")
        host = parts.hostname.lower()
        if not self._allowed(host):
            raise ImageRefused(f"the host {host!r} is not on this server's --image-urls list")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = self._checked_address(host, port)
        conn = _connection(parts.scheme, host, port, address, self._left(deadline), self.tls)
        # A hard deadline: a server that drips bytes, each within the socket timeout, is cut
        # off (its socket shut down, so a blocked read returns) when the time is up.
        watchdog = threading.Timer(self._left(deadline), _cut, [conn])
        watchdog.daemon = True
        watchdog.start()
        try:
            path = parts.path or "/"
            conn.request("GET", path + (f"?{parts.query}" if parts.query else ""))
            reply = conn.getresponse()
            self._left(deadline)  # cut off while the headers dripped in: say so
            if reply.status in (301, 302, 303, 307, 308):
                location = reply.getheader("Location")
                if not location:
                    raise ImageRefused(f"the image URL redirected ({reply.status}) to nowhere")
                return reply.status, location, b""
            body = self._read(reply, deadline)
            self._left(deadline)
            return reply.status, None, body
        except (OSError, http.client.HTTPException) as exc:
            self._left(deadline)  # cut off by the watchdog: say so
            raise ImageRefused(f"the image URL could not be fetched ({exc})") from None
        finally:
            watchdog.cancel()
            conn.close()

    def _allowed(self, host: str) -> bool:
        for entry in self.hosts:
            entry = entry.lower()
            if entry == "*" or entry == host:
                return True
            if entry.startswith("*.") and host.endswith(entry[1:]):
                return True
        return False

    def _checked_address(self, host: str, port: int) -> str:
        try:
            addresses = self.resolver(host, port)
        except OSError as exc:
            raise ImageRefused(f"the image URL's host {host!r} does not resolve ({exc})") from None
        if not addresses:
            raise ImageRefused(f"the image URL's host {host!r} does not resolve")
        for text in addresses:
            address = ipaddress.ip_address(text.split("%", 1)[0])
            if not public(address) and (str(address), port) not in self.trusted:
                raise ImageRefused(
                    f"the image URL's host {host!r} resolves to {address}, a private, loopback "
                    "or link-local address: refused"
                )
        return addresses[0]

    def _read(self, reply: http.client.HTTPResponse, deadline: float) -> bytes:
        length = reply.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            raise ImageRefused(f"the image at the URL is {length} bytes, over the cap")
        body = bytearray()
        while chunk := reply.read1(CHUNK):
            body += chunk
            if len(body) > self.max_bytes:
                raise ImageRefused(f"the image at the URL is over the {self.max_bytes}-byte cap")
            self._left(deadline)
        return bytes(body)

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ImageRefused(f"fetching the image URL took over {self.timeout} s")
        return left


def _cut(conn: http.client.HTTPConnection) -> None:
    """End a fetch past its deadline: a blocked read returns at once."""
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _connection(
    scheme: str, host: str, port: int, address: str, timeout: float, tls: ssl.SSLContext | None
) -> http.client.HTTPConnection:
    """A connection to `address` (already checked) that speaks to `host` (Host header, SNI)."""
    if scheme == "https":
        return _PinnedHTTPS(host, port, address, timeout, tls or ssl.create_default_context())
    return _PinnedHTTP(host, port, address, timeout)


class _PinnedHTTP(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(
        self, host: str, port: int, address: str, timeout: float, tls: ssl.SSLContext
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=tls)
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]
