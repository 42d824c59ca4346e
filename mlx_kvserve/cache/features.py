"""The vision encoder's output per image, kept under the image's digest, in RAM and on disk.

A vision model turns each image into features (an `mx.array`) before its text model reads them,
and agents resend every image of a conversation every turn: the tower need not run twice on one
picture. The key is `Image.digest` (a hash of the decoded pixels), never a path or a URL, which
can name other pixels tomorrow (mlx-vlm #1933 served stale features that way); the features also
depend on the model, so each model's prompt cache has its own (`PromptCache.features`).

RAM: the most recently used features within a byte budget. Disk: `<model dir>/features/
<digest>.feat`, in the prompt cache's entry format (cache/codec.py: magic, version, header
checksum, payload SHA-256) with one array, written as KV entries are: the host copy is made on
the caller's thread (it owns MLX); a writer thread checksums it, puts it in a temporary file,
fsyncs it, renames it and fsyncs the directory (durable.replace_file: 0600 in the 0700
directory). A file that fails any check (torn by a crash, garbled, another model's) is deleted
when read and counts as a miss: it is never served. Start-up deletes temporary leftovers.

Bounded: the files hold at most 1/FEATURE_SHARE of the prompt cache's disk budget in force, and
the KV entries leave them that room (`Policy.beside`), so together they stay within the budget;
the least recently used file goes first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import mlx.core as mx

from mlx_kvserve.cache import codec
from mlx_kvserve.cache.codec import HostArray, Slot
from mlx_kvserve.cache.dirs import private_subdir
from mlx_kvserve.cache.exceptions import EntryFormatError
from mlx_kvserve.cache.state import StateError, to_host, to_mx
from mlx_kvserve.durable import replace_file

DIR_NAME = "features"
SUFFIX = ".feat"
FEATURE_SHARE = 8  # of the disk budget (and of the RAM tier's budget) the features may hold
_DIGEST = re.compile(r"[0-9a-f]{16,128}")
_FORMAT = "features"


class FeatureCache:
    """One model's encoder outputs by image digest. `get` and `put` on the thread that owns MLX
    (the engine's); `disk_budget()` is the prompt cache's budget in force."""

    def __init__(
        self,
        directory: Path | None,
        fingerprint: str,
        *,
        ram_budget: int,
        disk_budget: Callable[[], int],
        logger: logging.Logger | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.ram_budget = self._full_ram_budget = max(0, ram_budget)
        self.disk_budget = disk_budget
        self.log = logger or logging.getLogger("mlx_kvserve.cache")
        self.root = directory  # the model's cache directory; ours is made at the first write
        self.dir = directory / DIR_NAME if directory is not None else None
        self._lock = threading.Lock()
        self._ram: OrderedDict[str, mx.array] = OrderedDict()  # least recently used first
        self._ram_bytes = 0
        self._files: OrderedDict[str, int] = OrderedDict()  # digest -> file bytes, LRU first
        self._pending: dict[str, HostArray] = {}  # host copies queued for the writer
        self._last: Future[None] | None = None  # the writer's newest job (it runs them in order)
        self._failing = False
        self.counters = dict.fromkeys(
            ("hits", "disk_hits", "misses", "stores", "evictions", "discarded", "write_errors"),
            0,
        )
        self._writer = ThreadPoolExecutor(1, "features-writer") if self.dir is not None else None
        if self.dir is not None and self.dir.exists():
            private_subdir(directory, DIR_NAME)  # a real directory of ours, 0700
            self._scan()

    # -- the API a vision model calls ------------------------------------------------------------
    def get(self, digest: str) -> mx.array | None:
        """The features stored for the image `digest`, or None."""
        if not _DIGEST.fullmatch(digest):
            return None
        with self._lock:
            if digest in self._ram:
                self._ram.move_to_end(digest)
                if digest in self._files:
                    self._files.move_to_end(digest)
                self.counters["hits"] += 1
                return self._ram[digest]
            queued = self._pending.get(digest)  # its write has not landed yet
            on_disk = digest in self._files and queued is None
        features = to_mx(queued) if queued is not None else None
        if on_disk:
            features = self._read(digest)
        with self._lock:
            if features is None:
                self.counters["misses"] += 1
                return None
            self.counters["hits"] += 1
            self.counters["disk_hits"] += on_disk
            if digest in self._files:
                self._files.move_to_end(digest)
            self._keep_in_ram(digest, features)
        if on_disk:
            with contextlib.suppress(OSError):
                os.utime(self._path(digest))  # recency survives a restart
        return features

    def put(self, digest: str, features: mx.array) -> None:
        """Keep `features` for the image `digest` (a no-op if they are kept already)."""
        if not _DIGEST.fullmatch(digest):
            raise ValueError(f"not an image digest: {digest!r}")
        with self._lock:
            if digest in self._ram:
                self._ram.move_to_end(digest)
                return
            self._keep_in_ram(digest, features)
            if self._writer is None or digest in self._files:
                return
        host = to_host("features", features)  # the writer thread never touches MLX
        size = len(self._head(digest, host, "0" * 64)) + host.nbytes
        with self._lock:
            cap = self.disk_budget() // FEATURE_SHARE
            if size > cap:
                return  # more than the whole share: RAM only
            self._files[digest] = size
            self._pending[digest] = host
            self.counters["stores"] += 1
            victims = self._over_budget(cap, keep=digest)
        for victim in victims:
            self._submit(self._delete, victim)
        self._submit(self._write, digest, host)

    # -- reports and life ------------------------------------------------------------------------
    def disk_bytes(self) -> int:
        """Bytes of the files (queued ones included): what the KV entries leave them."""
        with self._lock:
            return sum(self._files.values())

    def memory(self) -> tuple[int, int]:
        """(bytes of features in RAM, bytes of host copies queued for the disk): what the
        engine's memory ledger counts beside the KV (PromptCache.memory)."""
        with self._lock:
            return self._ram_bytes, sum(h.nbytes for h in self._pending.values())

    def limit_ram(self, share: float) -> None:
        """Keep `share` of the RAM budget (1.0 restores it), the system being short of memory."""
        with self._lock:
            self.ram_budget = int(self._full_ram_budget * max(0.0, min(1.0, share)))
        self.release_ram(self._ram_bytes - self.ram_budget)

    def release_ram(self, nbytes: int) -> int:
        """Drop the least recently used features from RAM until `nbytes` are freed (their
        files stay); the bytes freed."""
        freed = 0
        with self._lock:
            while self._ram and freed < nbytes:
                _, gone = self._ram.popitem(last=False)
                freed += gone.nbytes
            self._ram_bytes -= freed
        return freed

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                **{f"features_{name}": n for name, n in self.counters.items()},
                "features_ram_entries": len(self._ram),
                "features_ram_bytes": self._ram_bytes,
                "features_disk_entries": len(self._files),
                "features_disk_bytes": sum(self._files.values()),
            }

    def flush(self) -> None:
        """Wait for the queued writes and deletions."""
        last = self._last
        if last is not None:
            wait([last])

    def clear(self) -> int:
        """Forget every image (RAM and disk); how many files went."""
        with self._lock:
            self._ram.clear()
            self._ram_bytes = 0
            victims = list(self._files)
            self._files.clear()
        for digest in victims:
            self._submit(self._delete, digest)
        self.flush()
        return len(victims)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    # ------------------------------------------------------------------------------------------
    def _submit(self, job: Callable[..., None], *args: object) -> None:
        if self._writer is not None:
            self._last = self._writer.submit(job, *args)

    def _path(self, digest: str) -> Path:
        assert self.dir is not None
        return self.dir / f"{digest}{SUFFIX}"

    def _keep_in_ram(self, digest: str, features: mx.array) -> None:
        """(under the lock) Newest in RAM; the least recently used leave beyond the budget."""
        self._ram[digest] = features
        self._ram_bytes += features.nbytes
        while self._ram_bytes > self.ram_budget and self._ram:
            _, gone = self._ram.popitem(last=False)
            self._ram_bytes -= gone.nbytes

    def _over_budget(self, cap: int, keep: str) -> list[str]:
        """(under the lock) The least recently used files that must go to fit `cap`."""
        victims = []
        total = sum(self._files.values())
        for digest in list(self._files):
            if total <= cap:
                break
            if digest == keep:
                continue
            total -= self._files.pop(digest)
            self._pending.pop(digest, None)
            self.counters["evictions"] += 1
            victims.append(digest)
        return victims

    def _head(self, digest: str, host: HostArray, sha256: str) -> bytes:
        """Everything before the payload (its length does not depend on the checksum's value,
        so the file's size is known before the writer thread computes it)."""
        specs, size = codec.array_specs([host])
        header = {
            "format": _FORMAT,
            "fingerprint": self.fingerprint,
            "digest": digest,
            "arrays": specs,
            "payload_bytes": size,
            "payload_sha256": sha256,
        }
        return codec.pack_head(header, Slot())

    def _read(self, digest: str) -> mx.array | None:
        """A file's features, fully checked; a file that fails a check is deleted."""
        try:
            data = self._path(digest).read_bytes()
            header_len, digest_h, _ = codec.parse_prefix(data[: codec.PREFIX_SIZE])
            body = data[codec.PREFIX_SIZE : codec.PREFIX_SIZE + header_len]
            header = codec.parse_header(body, digest_h)
            if (header.get("format"), header.get("digest")) != (_FORMAT, digest):
                raise EntryFormatError("not this image's features")
            if header.get("fingerprint") != self.fingerprint:
                raise EntryFormatError("another model's features")
            payload = memoryview(data)[codec.payload_start(header_len) :]
            (host,) = codec.decode_payload(payload, header)
            if not codec.host_finite(host):
                raise EntryFormatError("features contain NaN or Inf")
            return to_mx(host)
        except FileNotFoundError:  # deleted by someone else: nothing to discard
            with self._lock:
                self._files.pop(digest, None)
            return None
        except (OSError, EntryFormatError, StateError, ValueError) as exc:
            with self._lock:
                self._files.pop(digest, None)
                self.counters["discarded"] += 1
            self.log.warning("prompt-cache discarded the features of image %s: %s", digest, exc)
            with contextlib.suppress(OSError):
                self._path(digest).unlink()
            return None

    def _write(self, digest: str, host: HostArray) -> None:
        """(writer thread) Durably write one file, unless it was evicted meanwhile."""
        with self._lock:
            if digest not in self._pending:
                return
        head = self._head(digest, host, codec.payload_digest([host]))
        data = head + codec.byte_view(host.data).tobytes()
        try:
            assert self.root is not None
            private_subdir(self.root, DIR_NAME)
            replace_file(self._path(digest), data, 0o600)
        except OSError as exc:
            with self._lock:
                self._files.pop(digest, None)
                self._pending.pop(digest, None)
                self.counters["write_errors"] += 1
                first, self._failing = not self._failing, True
            if first:
                self.log.warning("prompt-cache could not write image features: %s", exc)
            return
        with self._lock:
            self._failing = False
            if self._pending.pop(digest, None) is None:  # evicted while it was written
                self._delete(digest)

    def _delete(self, digest: str) -> None:
        with contextlib.suppress(OSError):
            self._path(digest).unlink()

    def _scan(self) -> None:
        """Index the files a previous run left (oldest use first); delete temporary ones."""
        assert self.dir is not None
        found = []
        for path in self.dir.iterdir():
            if path.name.startswith("."):  # durable.replace_file's temporary names
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            digest = path.name.removesuffix(SUFFIX)
            if path.name.endswith(SUFFIX) and _DIGEST.fullmatch(digest):
                with contextlib.suppress(OSError):
                    info = path.stat()
                    found.append((info.st_mtime, digest, info.st_size))
        for _, digest, size in sorted(found):
            self._files[digest] = size


__all__ = ["FEATURE_SHARE", "FeatureCache"]
