"""Real images made with Pillow, and a local HTTP server that serves them (and redirects), for
the image tests (docs/images.md)."""

from __future__ import annotations

import base64
import io
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def picture(width: int = 64, height: int = 40, color: tuple[int, int, int] = (200, 30, 30)):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), color)
    ImageDraw.Draw(image).rectangle((0, 0, width // 2, height // 2), fill=(10, 10, 240))
    return image


def encoded(
    fmt: str = "PNG",
    width: int = 64,
    height: int = 40,
    color: tuple[int, int, int] = (200, 30, 30),
    **save: object,
) -> bytes:
    """`picture` in `fmt`; `save`: Pillow's options for that format (e.g. lossless=True)."""
    out = io.BytesIO()
    picture(width, height, color).save(out, fmt, **save)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def huge_png(side: int = 20000) -> bytes:
    """A 20000 x 20000 one-bit PNG: about 50 KB that would decode to 400 million pixels."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (side, side)).save(out, "PNG")
    return out.getvalue()


SVG = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>'


@dataclass
class ImageServer:
    """`GET /image.png` the PNG; `/redirect?to=URL` a 302 to URL; `/slow` a header line
    dripped a byte every 0.1 s; anything else 404."""

    port: int = 0
    image: bytes = b""
    hits: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)  # the Host header of each request
    dripped: int = 0  # bytes `/slow` sent before it ended
    drip_ended: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@contextmanager
def image_server(image: bytes, tls: ssl.SSLContext | None = None) -> Iterator[ImageServer]:
    """The server on loopback (`tls`: HTTPS with that server context)."""
    state = ImageServer(image=image)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            state.hits.append(self.path)
            state.hosts.append(self.headers.get("Host", ""))
            if self.path == "/image.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(state.image)))
                self.end_headers()
                self.wfile.write(state.image)
            elif self.path == "/slow":  # a header, a byte every 0.1 s: within any socket timeout
                try:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
                    for _ in range(100):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        state.dripped += 1
                        time.sleep(0.1)
                except OSError:  # the client hung up
                    pass
                state.drip_ended.set()
            elif self.path.startswith("/redirect?to="):
                self.send_response(302)
                self.send_header("Location", self.path.removeprefix("/redirect?to="))
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
