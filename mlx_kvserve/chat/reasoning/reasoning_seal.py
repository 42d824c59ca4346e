"""Sealed reasoning: the replay handle behind Anthropic `signature` and Responses
`encrypted_content`.

A client replays the reasoning blocks it received, but the text it shows (and may send back) is not
always byte for byte what the model sampled: clients trim, summarise or drop it. A prompt cache only
hits when history re-renders to the tokens generated, so the server hands out the exact sampled
text sealed with a per-install key: `mkv1.<base64url(text)>.<base64url(HMAC-SHA256)>`. On replay a
seal that verifies gives back that exact text; a tampered, truncated or foreign one (Anthropic's
own signatures, another install's) does not verify and the block falls back to its visible text.
The text is authenticated, not hidden: the client has already seen it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from pathlib import Path

from mlx_kvserve import paths
from mlx_kvserve.chat.reasoning.seal_key import install_key

PREFIX = "mkv1"
MAX_SEAL_CHARS = 4 * 1024 * 1024  # a seal longer than any reasoning we would emit is foreign


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class ReasoningSeal:
    """Seals and opens reasoning text with one HMAC key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a reasoning-seal key needs at least 16 bytes")
        self._key = key

    @classmethod
    def for_install(cls, directory: Path | None = None) -> ReasoningSeal:
        """The install's key, made once (0600) in the data directory and kept across restarts,
        so a history replayed after a restart still opens (chat.reasoning.seal_key)."""
        return cls(install_key(directory or paths.data_dir()))

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, PREFIX.encode() + b"." + payload, hashlib.sha256).digest()

    def seal(self, text: str) -> str:
        payload = text.encode("utf-8")
        return f"{PREFIX}.{_b64(payload)}.{_b64(self._mac(payload))}"

    def open(self, sealed: object) -> str | None:
        """The sealed text, or None for anything this install did not seal unchanged."""
        if not isinstance(sealed, str) or len(sealed) > MAX_SEAL_CHARS:
            return None
        parts = sealed.split(".")
        if len(parts) != 3 or parts[0] != PREFIX:
            return None
        try:
            payload, mac = _unb64(parts[1]), _unb64(parts[2])
        except (binascii.Error, ValueError):
            return None
        if not hmac.compare_digest(mac, self._mac(payload)):
            return None
        try:
            return payload.decode("utf-8")
        except UnicodeDecodeError:
            return None
