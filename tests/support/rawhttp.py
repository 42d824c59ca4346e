"""Raw-socket HTTP for tests that need exact bytes: odd Host headers, silent or slow clients."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def read_response(sock: socket.socket) -> RawResponse | None:
    """One response (Content-Length bodies only); None if the server closed without one."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return RawResponse(int(lines[0].split()[1]), headers, body[:length])


def request(
    port: int,
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    body: bytes = b"",
    *,
    version: str = "HTTP/1.1",
) -> RawResponse:
    """Send exactly these headers (plus Content-Length when there is a body) and read the reply."""
    lines = [f"{method} {path} {version}", *(f"{k}: {v}" for k, v in headers)]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(raw)
        response = read_response(sock)
    assert response is not None, "the server closed the connection without answering"
    return response
