"""What a model that does not see images is shown in an image's place.

The note is a pure function of the image's format and size, so the same conversation renders
the same prompt every turn and the prompt cache reuses it (a screenshot in turn 1 costs nothing
on turn 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_kvserve.images.image import Image


def note(image: Image) -> str:
    """e.g. `[image: PNG 1280x800, not shown: this model does not see images]`."""
    return (
        f"[image: {image.format.upper()} {image.width}x{image.height}, "
        "not shown: this model does not see images]"
    )


def noted_text(parts: Sequence[str | Image]) -> str:
    """The turn's text with each image replaced by its note, on a line of its own."""
    pieces: list[str] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            pieces.append(part)
            continue
        before = "\n" if pieces and pieces[-1] and not pieces[-1].endswith("\n") else ""
        after = "\n" if i + 1 < len(parts) else ""
        pieces.append(f"{before}{note(part)}{after}")
    return "".join(pieces)
