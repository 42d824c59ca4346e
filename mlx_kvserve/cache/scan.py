"""What start-up finds in a cache directory: the entries' headers, the temporary leftovers of
interrupted writes, files evicted by an earlier run that could not delete them, and (for
`cache ls`) the directories of every model fingerprint under a cache root.

There is no index file: `scan` reads every entry's header, and recovery rebuilds the index
from what it returns.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from mlx_kvserve.cache import codec
from mlx_kvserve.cache.codec import Slot
from mlx_kvserve.cache.dirs import MARKER_NAME, TMP_PREFIX
from mlx_kvserve.cache.disk import NAMESPACES_DIR, SUFFIX, DiskTier, disk_fault, read_header_body
from mlx_kvserve.cache.entry import KEY_RE
from mlx_kvserve.cache.exceptions import EntryFormatError
from mlx_kvserve.cache.header import validate_header
from mlx_kvserve.json_value import JSON

Head = tuple[dict[str, JSON], Slot | None, int, int, bytes]


@dataclass
class ScannedEntry:
    key: str
    header: dict[str, JSON]
    tokens: np.ndarray
    slot: Slot | None
    file_bytes: int


def sweep_temp(disk: DiskTier) -> int:
    """Delete temporary leftovers of interrupted writes; how many went."""
    count = 0
    for path in disk.dir.iterdir():
        if path.name.startswith(TMP_PREFIX):
            with contextlib.suppress(OSError):  # one that stays is never read
                path.unlink()
                count += 1
    return count


def read_head(path: Path) -> Head:
    """(header, slot, payload offset, file size, header sha256) of an entry file, validated
    except for the payload."""
    key = path.name[: -len(SUFFIX)]
    if not KEY_RE.match(key):
        raise EntryFormatError("file name is not an entry key")
    with path.open("rb") as f:
        disk_fault("header")
        return _read_head(f)


def _read_head(f: BinaryIO) -> Head:
    size = os.fstat(f.fileno()).st_size
    header_len, digest, slot = codec.parse_prefix(f.read(codec.PREFIX_SIZE))
    body = read_header_body(f, header_len)
    header = codec.parse_header(body, digest)
    return header, slot, codec.payload_start(header_len), size, digest


def scan(disk: DiskTier) -> tuple[list[ScannedEntry], list[tuple[str, str]]]:
    """Headers of every entry file; damaged, unreadable or foreign files are reported (key,
    why), not returned. Files an earlier run evicted but could not delete are deleted now."""
    good: list[ScannedEntry] = []
    bad: list[tuple[str, str]] = []
    evicted = 0
    for path in disk.entry_files():
        key = path.name[: -len(SUFFIX)]
        try:
            header, slot, offset, size, digest = read_head(path)
            tokens = validate_header(header, key, disk.fingerprint, size, offset)
        except (EntryFormatError, OSError, ValueError) as exc:
            bad.append((key, str(exc)))
            continue
        if slot is not None and slot.flags & codec.FLAG_EVICTED:
            evicted += 1
            if not disk.read_only:
                disk.delete(key)
            continue
        disk.headers.remember(key, header, digest)
        good.append(ScannedEntry(key, header, tokens, slot, size))
    if evicted:
        disk.log.info("prompt-cache deleted %d files of entries evicted by an earlier run", evicted)
    return good, bad


def model_directories(root: Path) -> list[dict[str, JSON]]:
    """Per-fingerprint sub-directories of a cache root with their size (for `cache ls`).

    Directories of other fingerprints (an older model, mlx version or cache format) are never
    read by a running server and never counted against its budget: offer them for deletion.
    """
    out: list[dict[str, JSON]] = []
    root = Path(root)
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name == NAMESPACES_DIR:
            continue
        files = [p for p in d.iterdir() if p.name.endswith(SUFFIX)]
        size = 0
        for p in files:
            with contextlib.suppress(OSError):
                size += p.stat().st_size
        out.append(
            {
                "fingerprint": d.name,
                "entries": len(files),
                "bytes": size,
                "run_marker": (d / MARKER_NAME).exists(),  # running now, or died
            }
        )
    return out
