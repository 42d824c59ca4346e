"""The one internal form of an image a client sent."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Image:
    """An image decoded and checked once, at the edge.

    `digest` is the content key: a hash of the decoded pixels (with their size and mode), never
    of a path, a URL or the encoded bytes, so the same picture sent as PNG or as a data URL is
    one image, and two pictures are never one. `data` keeps the bytes as sent, for the vision
    processor; `origin` names the request field it came from, for errors and the log.
    """

    format: str  # read from the bytes ("png", "jpeg", "gif", "webp"), never from the client's label
    width: int
    height: int
    digest: str  # sha-256 hex of (width, height, mode, pixels)
    data: bytes
    origin: str = ""

    def describe(self) -> str:
        """A short human description: what a text-only model is told in the image's place."""
        return f"{self.format.upper()} image, {self.width}x{self.height}"
