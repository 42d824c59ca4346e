"""uvicorn's h11 protocol with a connection cap and a deadline for request headers.

uvicorn keeps a connection that never sends a byte open forever, and one that trickles its
headers a byte at a time (slowloris) too: a few thousand of them exhaust the open-file limit and
the server stops answering. Here:

* a connection gets `header_timeout` seconds, from its opening or from the end of its previous
  response, to deliver a complete request line and headers; then it is closed (with a 408 if
  it had started sending). uvicorn's keep-alive timeout still closes idle connections sooner.
* at most `max_connections` are open. A new connection beyond that closes the longest-idle one
  (no request in progress: a silent or slow connection, or an idle keep-alive), so a flood of
  silent connections cannot lock out real clients; if every connection is busy, the new one is
  answered 503 and closed.

Request bodies have their own deadline in `api.body`; running requests are never timed out.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

from uvicorn.protocols.http.h11_impl import H11Protocol

from mlx_kvserve.json_value import JSON
from mlx_kvserve.net.resources import Throttle

log = logging.getLogger("mlx_kvserve.net")


@dataclass
class ConnectionLimits:
    """Shared by every connection of one server; the counters are for logs and tests."""

    max_connections: int
    header_timeout: float
    throttle: Throttle = field(default_factory=Throttle)
    header_timeouts: int = 0
    evicted: int = 0
    refused: int = 0

    def note(self, kind: str, message: str) -> None:
        emit, held = self.throttle.allow(kind)
        if emit:
            more = f" ({held} more since the last report)" if held else ""
            log.warning(
                "%s%s; totals: header timeouts %d, idle connections closed %d, refused %d",
                message,
                more,
                self.header_timeouts,
                self.evicted,
                self.refused,
            )


def _raw_response(status: str, body: dict[str, JSON], extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"{extra}content-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def _error(message: str, kind: str, code: str) -> dict[str, JSON]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """An H11Protocol subclass bound to `limits`, to pass as uvicorn's `http=`."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _idle_since = 0.0
        _got_bytes = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections and not self._make_room():
                limits.refused += 1
                limits.note("refused", "connection limit reached with every connection busy")
                body = _error(
                    "The server has too many open connections; retry shortly.",
                    "server_error",
                    "server_unavailable",
                )
                transport.write(
                    _raw_response("503 Service Unavailable", body, "retry-after: 2\r\n")
                )
                transport.close()
                return
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            self._got_bytes = True
            super().data_received(data)
            if self._in_request():
                self._stop_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """A malformed request (bad syntax, missing Host): the error shape, then close."""
            body = _error(msg, "invalid_request_error", "bad_request")
            self.transport.write(_raw_response("400 Bad Request", body))
            self.transport.close()

        # -- helpers ---------------------------------------------------------------------------
        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _await_headers(self) -> None:
            self._stop_timer()
            self._idle_since = self.loop.time()
            self._got_bytes = False
            self._header_timer = self.loop.call_later(limits.header_timeout, self._headers_late)

        def _stop_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._in_request() or self.transport.is_closing():
                return
            limits.header_timeouts += 1
            limits.note(
                "header-timeout",
                "closed connections that sent no complete request "
                f"headers within {limits.header_timeout:g} s",
            )
            if self._got_bytes:
                body = _error(
                    "The request headers did not arrive in time.",
                    "invalid_request_error",
                    "request_timeout",
                )
                self.transport.write(_raw_response("408 Request Timeout", body))
            self.transport.close()

        def _make_room(self) -> bool:
            """Close the longest-idle other connection; False if all are busy."""
            idle = [
                c
                for c in self.connections
                if c is not self
                and isinstance(c, GuardedH11Protocol)
                and not c._in_request()
                and not c.transport.is_closing()
            ]
            if not idle:
                return False
            victim = min(idle, key=lambda c: c._idle_since)
            victim._stop_timer()
            victim.transport.close()
            limits.evicted += 1
            limits.note(
                "evicted",
                f"connection limit ({limits.max_connections}) reached: "
                "closing the longest-idle connections to make room",
            )
            return True

    return GuardedH11Protocol
