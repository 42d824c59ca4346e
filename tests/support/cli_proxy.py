"""A recording reverse proxy between a real agent CLI and the server under test.

The agent CLIs talk to the proxy as if it were the server; every request is forwarded
unchanged, the response streams back unchanged, and each exchange is recorded: method,
path with its query string, headers, the JSON body and the status the server answered. The tests
read the record to assert that every request the CLI sent was served, and `shapes.py` turns it
into the redacted fixtures that the fast tests replay.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class Exchange:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any
    status: int = 0
    response: bytes = b""

    def events(self) -> list[dict[str, Any]]:
        """The JSON payloads of a server-sent-event response, or the one JSON body."""
        text = self.response.decode("utf-8", "replace")
        lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        out = []
        for payload in lines or [text]:
            try:
                out.append(json.loads(payload))
            except ValueError:
                continue
        return out

    def cached_tokens(self) -> tuple[int, int] | None:
        """(prompt tokens, tokens read from the prompt cache) as this response reported them:
        Anthropic's `message_start` usage, or the Responses / chat `usage`."""
        for event in self.events():
            if not isinstance(event, dict):
                continue
            usage = (event.get("message") or event.get("response") or event).get("usage")
            if not isinstance(usage, dict):
                continue
            if "cache_read_input_tokens" in usage:
                read = usage["cache_read_input_tokens"] or 0
                return usage["input_tokens"] + read, read
            details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details")
            if details is not None:
                total = usage.get("input_tokens", usage.get("prompt_tokens", 0))
                return total, details.get("cached_tokens", 0)
        return None


@dataclass
class Recorder:
    exchanges: list[Exchange] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, exchange: Exchange) -> None:
        with self.lock:
            self.exchanges.append(exchange)

    def snapshot(self) -> list[Exchange]:
        with self.lock:
            return list(self.exchanges)


def _app(upstream: str, recorder: Recorder) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None))

    async def forward(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        exchange = Exchange(
            request.method, request.url.path, request.url.query, dict(request.headers), body
        )
        recorder.add(exchange)
        upstream_request = client.build_request(
            request.method,
            request.url.path,
            params=request.url.query or None,
            headers=headers,
            content=raw,
        )
        reply = await client.send(upstream_request, stream=True)
        exchange.status = reply.status_code
        out_headers = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_BY_HOP}

        async def relay():
            try:
                async for chunk in reply.aiter_raw():
                    exchange.response += chunk
                    yield chunk
            finally:
                await reply.aclose()

        return StreamingResponse(relay(), status_code=reply.status_code, headers=out_headers)

    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


class RecordingProxy:
    """The proxy on an ephemeral loopback port, served from a background thread."""

    def __init__(self, upstream: str) -> None:
        self.recorder = Recorder()
        config = uvicorn.Config(
            _app(upstream, self.recorder), host="127.0.0.1", port=0, log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._socket]))

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        for _ in range(600):
            if self._server.started:
                return self
            self._thread.join(0.05)
        raise RuntimeError("the recording proxy did not start")

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def exchanges(self) -> list[Exchange]:
        return self.recorder.snapshot()
