"""The image parts of every protocol, read the one way: base64, data URLs and http(s) URLs.

Each wire adapter finds its protocol's image field and hands its value here with the field's
path (`messages[2].content[1].image_url.url`); a refusal is the chat layer's InvalidRequest
naming that path, which every protocol renders as its own 400.

Agents resend every image of the conversation on every turn, so the reader keeps the images it
decoded lately, keyed by a hash of their encoded bytes (never by a URL: a URL is fetched
again each time, and what it answers is what counts).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import re
import threading
from collections import OrderedDict

from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.images.fetch import Fetcher
from mlx_kvserve.images.image import Image
from mlx_kvserve.images.pixels import ImageLimits, ImageRefused, decode_image

DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(;[^,;]*)*),(?P<data>.*)", re.DOTALL)
WHITESPACE = re.compile(rb"\s+")
SEEN_BYTES = 64 * 1024 * 1024  # encoded bytes of the images kept decoded


class ImageReader:
    """Turns what a client sent into an `Image`, under the server's caps and URL rules."""

    def __init__(self, limits: ImageLimits | None = None, fetcher: Fetcher | None = None) -> None:
        self.limits = limits or ImageLimits()
        self.fetcher = fetcher or Fetcher(max_bytes=self.limits.max_bytes)
        self._seen: OrderedDict[bytes, Image] = OrderedDict()  # newest last
        self._seen_bytes = 0
        self._lock = threading.Lock()  # adapters read images on the thread pool

    def from_base64(self, data: str, origin: str) -> Image:
        """Bare base64 (Anthropic's `source.data`, Ollama's `images`)."""
        return self._decode(_unbase64(data, origin, self.limits), origin)

    def from_url(self, url: str, origin: str) -> Image:
        """A data URL, or an http(s) URL fetched when the server allows it."""
        if url[:5].lower() == "data:":
            match = DATA_URL.fullmatch(url)
            if match is None or ";base64" not in match.group("params").lower():
                raise _refused(origin, "a data URL must be base64: data:image/png;base64,...")
            return self.from_base64(match.group("data"), origin)
        if urlsplit_scheme(url) not in ("http", "https"):
            raise _refused(origin, "expected a data: URL or an http(s) URL")
        try:
            data = self.fetcher.fetch(url)
        except ImageRefused as exc:
            raise _refused(origin, str(exc)) from None
        return self._decode(data, origin)

    def _decode(self, data: bytes, origin: str) -> Image:
        key = hashlib.sha256(data).digest()
        with self._lock:
            image = self._seen.get(key)
            if image is not None:
                self._seen.move_to_end(key)
                return dataclasses.replace(image, origin=origin)
        try:
            image = decode_image(data, self.limits, origin)
        except ImageRefused as exc:
            raise _refused(origin, str(exc)) from None
        self._keep(key, image)
        return image

    def _keep(self, key: bytes, image: Image) -> None:
        with self._lock:
            if key in self._seen:
                return
            self._seen[key] = image
            self._seen_bytes += len(image.data)
            while self._seen_bytes > SEEN_BYTES and self._seen:
                _, old = self._seen.popitem(last=False)
                self._seen_bytes -= len(old.data)


def urlsplit_scheme(url: str) -> str:
    head, sep, _ = url.partition(":")
    return head.lower() if sep else ""


def _unbase64(data: str, origin: str, limits: ImageLimits) -> bytes:
    raw = WHITESPACE.sub(b"", data.encode("ascii", errors="replace"))
    if len(raw) * 3 // 4 > limits.max_bytes + 3:  # refused before it is decoded
        raise _refused(origin, f"the image is over the {limits.max_bytes}-byte cap")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise _refused(origin, "not valid base64") from None


def _refused(origin: str, why: str) -> InvalidRequest:
    message = f"Invalid image in '{origin}': {why}."
    return InvalidRequest(message, param=origin, code="invalid_image")
