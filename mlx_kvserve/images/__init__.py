"""Images in conversations: what clients send, decoded once and keyed by their pixels.

The wire adapters (api/) turn each protocol's image part into an `Image`; the chat layer keeps
it in its place among the message's text (`Message.parts`); a vision model sees it, a text model
is shown a note instead; the prompt cache keys its span by `Image.digest`.
"""

from mlx_kvserve.images.image import Image

__all__ = ["Image"]
