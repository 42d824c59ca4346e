"""An image's place in a rendered prompt, and the `ImageSpan` of its placeholder tokens.

Each image of a turn is first a sentinel in its message's text (`place`), so the chat template
and every tool format (a tool result folded into a user turn, a system prompt extended with
tools) carry it where the client put it, whatever they do with the text around it. The
rendered text's sentinels are then replaced by the family's own markup for the image, the text
its processor inserts (Gemma 3: `<start_of_image>`, `mm_tokens_per_image` x
`<image_soft_token>`, `<end_of_image>`), and the tokenized prompt's runs of the placeholder id
are the images' spans, in order. A sentinel carries a per-render nonce, so a client's text can
never pose as one; a client's text holding placeholder tokens itself is a 400.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Sequence

from mlx_kvserve.chat.invalid_request import InvalidRequest
from mlx_kvserve.chat.request import Message
from mlx_kvserve.engine.image_prefill import Markup
from mlx_kvserve.images.image import Image
from mlx_kvserve.images.spans import ImageSpan


class Placement:
    """One render's images: sentinels in, markup out, spans found."""

    def __init__(self, markup: Markup) -> None:
        self._markup = markup
        self._nonce = secrets.token_hex(8)
        self._pattern = re.compile(rf"<\|kvserve-image-(\d+)-{self._nonce}\|>")
        self.images: list[Image] = []

    def place(self, messages: Sequence[Message]) -> list[Message]:
        """`messages` with each image a sentinel in its text (parts dropped: the template
        sees text)."""
        out = []
        for message in messages:
            if not message.parts:
                out.append(message)
                continue
            pieces = []
            for part in message.parts:
                if isinstance(part, Image):
                    pieces.append(f"<|kvserve-image-{len(self.images)}-{self._nonce}|>")
                    self.images.append(part)
                else:
                    pieces.append(part)
            out.append(dataclasses.replace(message, content="".join(pieces), parts=()))
        return out

    def expand(self, text: str) -> str:
        """The rendered text with each sentinel replaced by its image's markup."""
        return self._pattern.sub(lambda m: self._markup.markup(self.images[int(m[1])])[0], text)

    def spans(
        self, text: str, tokens: Sequence[int]
    ) -> tuple[tuple[Image, ...], tuple[ImageSpan, ...]]:
        """The images in prompt order and their spans in `tokens` (the rendered `text`,
        expanded and tokenized)."""
        order = [self.images[int(m[1])] for m in self._pattern.finditer(text)]
        runs = placeholder_runs(tokens, self._markup.image_token)
        expected = [self._markup.markup(image)[1] for image in order]
        if [length for _, length in runs] != expected:
            raise InvalidRequest(
                "The messages' text holds the model's image placeholder tokens: "
                f"{len(runs)} run(s) of them for {len(order)} image(s).",
                param="messages",
            )
        spans = tuple(
            ImageSpan(start, length, image.digest)
            for (start, length), image in zip(runs, order, strict=True)
        )
        return tuple(order), spans


def placeholder_runs(tokens: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `tokens`."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*tokens, -1]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i - start))
            start = None
    return runs
