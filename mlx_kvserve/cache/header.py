"""Checks of an entry file's header against its name, its model and its size. No MLX here:
the writer thread runs them too (read-backs), and start-up runs them on every file."""

from __future__ import annotations

import hashlib

import numpy as np

from mlx_kvserve.cache import codec, plan
from mlx_kvserve.cache.entry import DELTA, SNAPSHOT, entry_key
from mlx_kvserve.cache.exceptions import EntryFormatError
from mlx_kvserve.cache.plan import PlanError
from mlx_kvserve.json_value import JSON


def validate_header(
    header: dict[str, JSON], key: str, fingerprint: str, file_bytes: int, payload_offset: int
) -> np.ndarray:
    """Check a parsed header against its file name, model, and size; returns its tokens."""
    if header.get("format") != codec.FORMAT_VERSION:
        raise EntryFormatError(f"header format {header.get('format')!r}")
    if header.get("fingerprint") != fingerprint:
        raise EntryFormatError(f"fingerprint {header.get('fingerprint')!r} is another model's")
    if header.get("key") != key:
        raise EntryFormatError("header key does not match the file name")
    try:
        tokens = codec.decode_tokens(header["tokens"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EntryFormatError(f"bad token ids: {exc}") from None
    if header.get("n_tokens") != tokens.shape[0] or tokens.shape[0] == 0:
        raise EntryFormatError(
            f"header claims {header.get('n_tokens')} tokens, holds {tokens.shape[0]}"
        )
    if entry_key(fingerprint, tokens) != key:
        raise EntryFormatError("token ids do not hash to the file name")
    kind = header.get("kind")
    parent = header.get("parent")
    parent_len = header.get("parent_len")
    if kind not in (DELTA, SNAPSHOT) or not isinstance(parent_len, int):
        raise EntryFormatError(f"bad kind/parent_len {kind!r}/{parent_len!r}")
    if parent is None:
        if parent_len != 0:
            raise EntryFormatError("parent_len without a parent")
    elif (
        not isinstance(parent, str)
        or not 0 < parent_len < tokens.shape[0]
        or entry_key(fingerprint, tokens[:parent_len]) != parent
    ):
        raise EntryFormatError("parent does not match the entry's token prefix")
    probe = header.get("probe")
    if probe is not None and not (
        isinstance(probe, dict)
        and isinstance(probe.get("position"), int)
        and isinstance(probe.get("ids"), list)
        and isinstance(probe.get("logprobs"), list)
    ):
        raise EntryFormatError("malformed probe")
    if not isinstance(header.get("reason", ""), str) or not isinstance(
        header.get("created", 0.0), (int, float)
    ):
        raise EntryFormatError("malformed reason/created")
    specs = codec.check_array_specs(header)
    layout = {str(s["name"]): (str(s["dtype"]), tuple(int(d) for d in s["shape"])) for s in specs}
    if len(layout) != len(specs):
        raise EntryFormatError("two arrays share a name")
    meta = header.get("meta")
    try:
        plan.check_meta(meta, layout, tokens.shape[0], parent_len)
    except PlanError as exc:
        raise EntryFormatError(str(exc)) from None
    if (kind == DELTA) != plan.trimmable(meta["layers"]):
        raise EntryFormatError(f"kind {kind!r} does not match its layers")
    if file_bytes != payload_offset + header["payload_bytes"]:
        raise EntryFormatError(
            f"file is {file_bytes} bytes, header implies {payload_offset + header['payload_bytes']}"
        )
    return tokens


# What a restore needs of a header it has already validated.
_VETTED_KEYS = ("arrays", "payload_bytes", "payload_sha256", "kind", "parent", "parent_len")


class VettedHeaders:
    """Headers validated in full once (at the scan, or at the first read), recognised again by
    the sha256 of their bytes: a file whose header bytes hash the same holds that same header,
    so a restore of a long chain of small links skips the JSON parse and the checks, which
    dominated its time. A changed header is parsed and checked again."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self._seen: dict[str, tuple[bytes, dict[str, JSON]]] = {}  # key -> (digest, parts)

    def remember(self, key: str, header: dict[str, JSON], digest: bytes) -> None:
        """Keep the parts of a header that passed `validate_header` (`digest`: its sha256)."""
        self._seen[key] = (digest, {name: header.get(name) for name in _VETTED_KEYS})

    def forget(self, key: str) -> None:
        self._seen.pop(key, None)

    def checked(
        self, key: str, body: bytes, digest: bytes, size: int, offset: int, *, vetted: bool
    ) -> dict[str, JSON]:
        """The validated header of a file of `size` bytes whose header bytes are `body`
        (`digest`: the sha256 its prefix states). `vetted`: one seen before is not parsed
        again, and only its `_VETTED_KEYS` are returned."""
        known = self._seen.get(key) if vetted else None
        if known is not None and known[0] == digest == hashlib.sha256(body).digest():
            header = known[1]
            if size != offset + header["payload_bytes"]:
                raise EntryFormatError("file size changed since its header was checked")
            return header
        header = codec.parse_header(body, digest)
        validate_header(header, key, self.fingerprint, size, offset)
        self.remember(key, header, digest)
        return header
