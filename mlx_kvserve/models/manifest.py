"""Manifests for converted model directories, and the model fingerprint source.

A converted model directory is only trusted when its ``manifest.json`` (written last, after every
other file was fsynced) lists exactly the files present, with matching sizes and SHA-256 digests.
A full SHA-256 pass over the ~540 MB float32 default model takes about 0.35 s on a 2-core x86
machine with SHA-NI (hashlib releases the GIL and runs near memory speed), and the same bytes are
read again right after by the loader from the page cache, so we simply hash every file in full:
cheaper schemes (sampling, size+mtime) would miss a single flipped byte.

A user's model directory (no manifest, often tens of GB) is identified by the size and a sampled
SHA-256 of each weight file (`sampled_sha256`: 32 blocks of 64 KiB at fixed offsets, the first
and the last included): by content, so a copy made with `cp -r` or `scp -r` (new mtimes, another
directory name) is the same model on every host of a job, at the cost of 2 MiB read a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..durable import fsync_fd, fsync_path
from ..json_value import JSON

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 4 << 20
SAMPLE_BLOCKS = 32  # blocks of a weight file a user's model is identified by
SAMPLE_BYTES = 64 << 10

# Files that determine tokenization / chat formatting (and so which token ids a prompt becomes).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")


def sha256_file(path: Path) -> str:
    """Streaming SHA-256 of a file (one reusable buffer, GIL released while hashing)."""
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            digest.update(view[:n])
    return digest.hexdigest()


def sample_offsets(size: int) -> list[int]:
    """Where `sampled_sha256` reads a file of `size` bytes: evenly spaced blocks from the first
    to the last, or the whole file when it is not larger than the blocks together."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return list(range(0, size, SAMPLE_BYTES))
    span = size - SAMPLE_BYTES
    return [span * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]


def sampled_sha256(path: Path) -> str:
    """SHA-256 of a file's size and its blocks at `sample_offsets`: cheap on multi-GB weights,
    the same for a copy, different for a file whose size or sampled bytes changed."""
    size = path.stat().st_size
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb", buffering=0) as f:
        for offset in sample_offsets(size):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _listed_files(model_dir: Path) -> list[str]:
    return sorted(
        str(p.relative_to(model_dir))
        for p in model_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME
    )


def write_manifest(model_dir: Path, extra: Mapping[str, JSON]) -> dict[str, JSON]:
    """Hash every file in ``model_dir``, fsync them, then atomically write ``manifest.json``.

    Call this last: a directory with a manifest claims to be complete. ``extra`` (source hash,
    converter version, ...) is stored alongside the file list.
    """
    files = {}
    for rel in _listed_files(model_dir):
        path = model_dir / rel
        fsync_path(path)
        files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format": MANIFEST_FORMAT, **extra, "files": files}
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST_NAME}.", dir=model_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            fsync_fd(f.fileno())
        os.replace(tmp, model_dir / MANIFEST_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(model_dir)
    return manifest


def read_manifest(model_dir: Path) -> dict[str, JSON] | None:
    """The parsed manifest, or None when it is missing or unreadable."""
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    return manifest


def verify_manifest(model_dir: Path, expect: Mapping[str, JSON] | None = None) -> str | None:
    """Check ``model_dir`` against its manifest; return None if intact, else why not.

    Catches a missing manifest, missing or unexpected files, size mismatches, any changed byte
    (full SHA-256), and manifest fields that differ from ``expect`` (e.g. a newer converter).
    """
    if not model_dir.is_dir():
        return "directory missing"
    manifest = read_manifest(model_dir)
    if manifest is None:
        return "manifest missing or unreadable"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"manifest format {manifest.get('format')!r} != {MANIFEST_FORMAT}"
    for key, value in (expect or {}).items():
        if manifest.get(key) != value:
            return f"manifest {key} is {manifest.get(key)!r}, expected {value!r}"
    files: dict[str, JSON] = manifest["files"]
    present = set(_listed_files(model_dir))
    if unexpected := sorted(present - set(files)):
        return f"unexpected files {unexpected}"
    # Cheap checks for every file first, so a truncation is reported without hashing anything.
    for rel, info in files.items():
        path = model_dir / rel
        if rel not in present:
            return f"{rel} missing"
        if path.stat().st_size != info.get("size"):
            return f"{rel} has size {path.stat().st_size}, manifest says {info.get('size')}"
    for rel, info in files.items():
        if sha256_file(model_dir / rel) != info.get("sha256"):
            return f"{rel} sha256 mismatch"
    return None


def _hash_files(paths: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        digest.update(sha256_file(path).encode() + b"\n")
    return digest.hexdigest()


def model_fingerprint_source(model_dir: Path) -> dict[str, JSON]:
    """What identifies a loaded model for prompt-cache keys: weights, config and tokenizer.

    Weights are identified by the manifest's SHA-256 digests when a manifest exists (converted
    models), else by weight file names, sizes and sampled SHA-256 (cheap, for large user models;
    the scheme was size and mtime before, so such a model's prompt cache started afresh once).
    """
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    weights: dict[str, JSON]
    if manifest is not None:
        weights = {
            "scheme": "manifest-sha256",
            "files": {
                rel: info.get("sha256")
                for rel, info in sorted(manifest["files"].items())
                if rel.endswith(_WEIGHT_SUFFIXES)
            },
        }
    else:
        weights = {
            "scheme": "size-sampled-sha256",
            "files": {
                str(p.relative_to(model_dir)): [p.stat().st_size, sampled_sha256(p)]
                for p in sorted(model_dir.rglob("*"))
                if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)
            },
        }
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    tokenizer_paths = [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    return {
        "weights": weights,
        "config": config,
        "tokenizer_sha256": _hash_files(tokenizer_paths),
        "tokenizer_files": [p.name for p in tokenizer_paths],
    }
