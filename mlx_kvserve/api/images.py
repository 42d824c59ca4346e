"""Images at the API's edge: the server's image reader, and what a model that does not see
images is given instead (docs/images.md).

The adapters read their protocol's image fields with `image_reader(request)`; `start_chat`
then asks `for_model` what the chosen model is shown: the images themselves when it sees them
(`Slot.sees_images`), else each one's note (`--images note`), or a 400 (`--images reject`).
"""

from __future__ import annotations

import dataclasses
import logging

from starlette.requests import Request

from mlx_kvserve.api.errors import APIError
from mlx_kvserve.chat import ChatRequest
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.images.fetch import Fetcher
from mlx_kvserve.images.note import noted_text
from mlx_kvserve.images.pixels import ImageLimits
from mlx_kvserve.images.reader import ImageReader
from mlx_kvserve.models.pool import Slot

log = logging.getLogger("mlx_kvserve.api")


def make_image_reader(settings: Settings) -> ImageReader:
    """The reader of `--max-image-bytes`, `--max-image-pixels` and `--image-urls`."""
    limits = ImageLimits(settings.max_image_bytes, settings.max_image_pixels)
    fetcher = Fetcher(
        tuple(settings.image_urls), settings.max_image_bytes, settings.image_url_timeout
    )
    return ImageReader(limits, fetcher)


def image_reader(request: Request) -> ImageReader:
    """The app's reader (`app.state.image_reader`: a test may put its own there)."""
    return request.app.state.image_reader


def for_model(chat: ChatRequest, slot: Slot, policy: str) -> ChatRequest:
    """`chat` as `slot`'s model may see it: its images replaced by notes for a model that does
    not see images (logged once), or a 400 naming the model under `--images reject`."""
    images = [image for message in chat.messages for image in message.images]
    if not images or slot.sees_images:
        return chat
    if policy == "reject":
        raise APIError(
            400,
            f"The model {slot.name!r} does not see images, and this server refuses images for "
            f"such models (--images reject); '{images[0].origin}' holds one.",
            param=images[0].origin or "messages",
            code="images_not_supported",
        )
    log.info(
        "%d image(s) shown to %r as a note: it does not see images (%s)",
        len(images),
        slot.name,
        ", ".join(image.describe() for image in images[:3]),
    )
    messages = [
        dataclasses.replace(m, content=noted_text(m.parts), parts=()) if m.parts else m
        for m in chat.messages
    ]
    return dataclasses.replace(chat, messages=messages)
