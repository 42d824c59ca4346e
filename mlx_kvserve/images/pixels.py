"""Bytes a client sent, checked and decoded into an `Image`, or a clear refusal.

The format comes from the bytes (Pillow's magic-number sniffing), never from the client's label:
clients send PNG screenshots as `image/jpeg`. Before any pixel is decoded the header's size is
held against the pixel cap, so a small file that would unpack into gigabytes (a decompression
bomb) is refused unread; SVG is refused (it is a program that draws, not pixels).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from mlx_kvserve.images.image import Image

FORMATS = {"PNG": "png", "JPEG": "jpeg", "GIF": "gif", "WEBP": "webp"}
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_PIXELS = 50_000_000  # e.g. 8192 x 6103; a 20000 x 20000 image is 400 million


class ImageRefused(ValueError):
    """An image the server will not take: the message says why, for the client's 400."""


@dataclass(frozen=True)
class ImageLimits:
    """How large an image may be: its encoded bytes and its decoded pixels."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS


def decode_image(data: bytes, limits: ImageLimits, origin: str = "") -> Image:
    """The image in `data`; ImageRefused when it is none, too large, broken or SVG."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if not data:
        raise ImageRefused("the image is empty")
    if len(data) > limits.max_bytes:
        raise ImageRefused(f"the image is {len(data)} bytes, over the {limits.max_bytes}-byte cap")
    if _looks_like_svg(data):
        raise ImageRefused("SVG images are not accepted (send PNG, JPEG, GIF or WebP)")
    try:
        with warnings.catch_warnings():
            # the cap below is ours; Pillow's own refuses only past twice its default
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            picture = PILImage.open(io.BytesIO(data), formats=list(FORMATS))
            width, height = picture.size
            if width * height > limits.max_pixels:
                raise ImageRefused(
                    f"the image is {width}x{height} pixels, over the {limits.max_pixels}-pixel cap"
                )
            picture.load()  # every pixel decoded now: a truncated or corrupt file fails here
    except ImageRefused:
        raise
    except UnidentifiedImageError:
        raise ImageRefused("the bytes are not an image (PNG, JPEG, GIF or WebP)") from None
    except PILImage.DecompressionBombError:
        raise ImageRefused("the image decompresses to too many pixels") from None
    except Exception as exc:  # Pillow's parsers fail on hostile bytes in many ways
        raise ImageRefused(f"the image is truncated or corrupt ({exc})") from None
    fmt = FORMATS[picture.format or ""]
    return Image(fmt, width, height, pixel_digest(picture), data, origin)


def pixel_digest(picture: object) -> str:
    """SHA-256 of the size, mode and pixels: the same picture in any encoding is one key."""
    from PIL import Image as PILImage

    assert isinstance(picture, PILImage.Image)
    h = hashlib.sha256()
    h.update(f"{picture.width}x{picture.height}:{picture.mode}:".encode())
    h.update(picture.tobytes())
    return h.hexdigest()


def _looks_like_svg(data: bytes) -> bool:
    head = data[:1024].lstrip().lower()
    return head.startswith((b"<svg", b"<?xml", b"<!doctype svg")) or b"<svg" in head
