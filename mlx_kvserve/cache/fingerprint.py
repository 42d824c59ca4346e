"""Model fingerprints: which stored KV states a loaded model may reuse.

Two processes may share a checkpoint only if they would compute identical KV for identical
tokens, so the fingerprint covers the weights' identity, the model config, the tokenizer, the
cache file format, and the mlx / mlx-lm versions (KV layouts and kernels change between them).
It names the per-model sub-directory, so it is short and filesystem-safe.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path

from mlx_kvserve.cache.codec import FORMAT_VERSION
from mlx_kvserve.json_value import JSON


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def layout_versions() -> dict[str, str]:
    """Versions that affect the bytes of a stored KV state."""
    return {
        "cache_format": str(FORMAT_VERSION),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
    }


def hash_file(path: Path, *, chunk: int = 8 << 20) -> str:
    """sha256 of a file's contents (weights, tokenizer files)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_files(paths: Iterable[Path], *, full: bool = True) -> str:
    """One digest over several files, keyed by file name.

    `full=False` hashes name, size and mtime only: fast for multi-GB weights, at the price of
    trusting that nobody rewrites a file in place with identical size and mtime.
    """
    h = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        h.update(path.name.encode() + b"\0")
        if full:
            h.update(hash_file(path).encode())
        else:
            st = os.stat(path)
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _canonical(value: object) -> JSON:
    """`value` as JSON with sorted keys; what JSON cannot hold, as its repr."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def model_fingerprint(
    *,
    weights: str,
    config: Mapping[str, JSON],
    tokenizer: str,
    extra: Mapping[str, JSON] | None = None,
    name: str | None = None,
) -> str:
    """Fingerprint string such as `smollm2-135m-instruct-3f2a9c0d1e4b5a6c`.

    `weights` / `tokenizer` are content digests (see `hash_files`), `config` the model config
    dict, `extra` anything else that changes KV (e.g. a dtype override, kv quantisation bits).
    `name` only makes the directory readable; the hash decides identity.
    """
    doc = {
        "weights": weights,
        "config": _canonical(config),
        "tokenizer": tokenizer,
        "extra": _canonical(extra or {}),
        "versions": layout_versions(),
    }
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    if name:
        slug = "".join(c if c.isalnum() or c in "._-" else "-" for c in name.lower()).strip("-.")
        slug = slug[:48].strip("-.")
        if slug:
            return f"{slug}-{digest}"
    return digest
