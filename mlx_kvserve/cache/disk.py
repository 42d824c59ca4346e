"""Disk tier: one directory per model fingerprint, one file per entry, no index file.

Crash safety (DESIGN invariant 6):

* Writes go to `.tmp.<key>.<pid>.<n>` in the same directory, are fsync'd (F_FULLFSYNC on macOS,
  where plain fsync does not flush the drive cache), renamed to `<key>.kvc`, and the directory
  is fsync'd. A kill at any instant leaves either no file or a complete one; start-up sweeps the
  temporary leftovers.
* The rename happens under `fs_lock` after re-checking the job's `cancelled` flag, and deletes
  take the same lock, so an entry evicted while its write is in flight can never reappear.
* `RUNNING` is the run marker: created at open, removed at clean close. Finding it at open means
  the last run died; its entries are flagged suspect (in their slots, fsync'd) before the new
  marker replaces it.
* `lock` carries an exclusive, non-blocking `flock`: one writer process per directory. Both are
  the directory's guards (cache/dirs.py).

A failing disk never escapes as an error of a request: a failed write raises to the writer
thread, which loses only that checkpoint; a failed read raises to the restore, which evicts the
entry. A file that cannot be deleted (EACCES, EIO) is marked evicted in its slot, kept in
`undeleted` and deleted later (`retry_deletions`), or at the next start instead of being indexed.
The points where tests make the disk fail are `disk_fault`'s (see engine.faults).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from mlx_kvserve import macos
from mlx_kvserve.cache import codec
from mlx_kvserve.cache.codec import HostArray, Slot
from mlx_kvserve.cache.dirs import FILE_MODE, TMP_PREFIX, DirectoryGuards, private_subdir
from mlx_kvserve.cache.exceptions import EntryFormatError
from mlx_kvserve.cache.header import VettedHeaders
from mlx_kvserve.cache.pipeline import Check, read_verified
from mlx_kvserve.durable import fsync_fd, fsync_path, write_all
from mlx_kvserve.json_value import JSON

SUFFIX = ".kvc"
NAMESPACES_DIR = "keys"  # per-API-key caches (--isolate-cache): keys/<namespace>/<fingerprint>
RADVISORY = "qi4x"  # macOS's struct radvisory {off_t ra_offset; int ra_count;}, padded to 16
RA_COUNT_MAX = 2**31 - 1


def read_header_body(f: BinaryIO, header_len: int) -> bytes:
    body = f.read(header_len)
    if len(body) != header_len:
        raise EntryFormatError("file truncated inside its header")
    return body


def advise_read(fd: int) -> None:
    """Ask the kernel to start reading a whole open file: posix_fadvise where the OS has it,
    F_RDADVISE on macOS (whose Python has no posix_fadvise), nothing elsewhere."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    elif macos.on_macos():
        count = min(os.fstat(fd).st_size, RA_COUNT_MAX)
        macos.fcntl(fd, macos.F_RDADVISE, struct.pack(RADVISORY, 0, count))


def fault_point(point: str) -> None:
    """Test-only fault point (see engine.faults); does nothing unless MLX_KVSERVE_FAULTS is set."""
    if os.environ.get("MLX_KVSERVE_FAULTS"):
        from mlx_kvserve.engine import faults  # imported late: the engine imports this package

        faults.maybe_fail(point)


def disk_fault(op: str) -> None:
    """Test-only point `disk_<op>_<errno>` (engine.faults.DISK_OPS): raises that OSError."""
    if os.environ.get("MLX_KVSERVE_FAULTS"):
        from mlx_kvserve.engine import faults

        faults.maybe_fail_disk(op)


class Cancellable(Protocol):
    """A queued write (cache/writer.py's `WriteJob`): the engine may cancel it until it lands."""

    cancelled: bool


class DiskTier(DirectoryGuards):
    """Files of one model fingerprint under `root/<fingerprint>/`."""

    def __init__(
        self, root: Path, fingerprint: str, log: logging.Logger, *, read_only: bool = False
    ) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.dir = self.root / fingerprint
        self._dir_name = str(self.dir)
        self.log = log
        self.read_only = read_only
        self.fs_lock = threading.Lock()
        self.headers = VettedHeaders(fingerprint)
        self._lock_fd: int | None = None
        self._tmp_counter = itertools.count()
        # evicted entries whose file could not be deleted: key -> why (under fs_lock)
        self.undeleted: dict[str, str] = {}
        if read_only:
            return
        private_subdir(self.root, fingerprint)  # the root the user named is never chmod'ed
        self._acquire_lock()

    # -- files ------------------------------------------------------------------------------
    def entry_files(self) -> Iterator[Path]:
        if not self.dir.is_dir():
            return
        for path in self.dir.iterdir():
            if path.name.endswith(SUFFIX) and not path.name.startswith("."):
                yield path

    # -- entries -------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def _file(self, key: str) -> str:
        """`path(key)` as a string, built without pathlib (restores open dozens per call)."""
        return os.path.join(self._dir_name, key + SUFFIX)

    def _open(self, key: str, buffering: int = -1) -> BinaryIO:
        try:
            return open(self._file(key), "rb", buffering=buffering)  # noqa: SIM115
        except FileNotFoundError:
            raise EntryFormatError("file is missing") from None

    @contextlib.contextmanager
    def _open_entry(
        self, key: str, *, vetted: bool = False
    ) -> Iterator[tuple[BinaryIO, dict[str, JSON]]]:
        """An entry's file, positioned at its payload, with its validated header (`vetted`:
        see `VettedHeaders.checked`)."""
        with self._open(key) as f:
            disk_fault("header")
            size = os.fstat(f.fileno()).st_size
            header_len, digest, _ = codec.parse_prefix(f.read(codec.PREFIX_SIZE))
            body = read_header_body(f, header_len)
            offset = codec.payload_start(header_len)
            header = self.headers.checked(key, body, digest, size, offset, vetted=vetted)
            f.seek(offset)
            yield f, header

    def prefetch(self, keys: list[str]) -> None:
        """Ask the kernel to start reading these (small) files now, all at once, so that the
        device serves them in parallel while the caller works through them in order. A hint:
        nothing it meets (a file gone, a call this OS lacks or refuses) fails the restore."""
        for key in keys:
            try:
                disk_fault("prefetch")
                fd = os.open(self._file(key), os.O_RDONLY)
            except OSError:
                continue  # the read that follows reports it
            try:
                advise_read(fd)
            except Exception as exc:  # the reads work without the hint
                self.log.debug("prompt-cache read-ahead hint refused: %r", exc)
            finally:
                os.close(fd)

    def read_entry(
        self, key: str, *, vetted: bool = False, finite: bool = False
    ) -> tuple[dict[str, JSON], list[HostArray]]:
        """Read and fully verify one entry: header checks and payload checksum (`vetted`: see
        `VettedHeaders.checked`; `finite`: float arrays holding NaN/Inf are a format error too)."""
        with self._open(key, buffering=0) as f:
            disk_fault("read")
            data = f.read()  # one call: one request to the device for a small file
        header_len, digest, _ = codec.parse_prefix(data[: codec.PREFIX_SIZE])
        body = data[codec.PREFIX_SIZE : codec.PREFIX_SIZE + header_len]
        if len(body) != header_len:
            raise EntryFormatError("file truncated inside its header")
        offset = codec.payload_start(header_len)
        header = self.headers.checked(key, body, digest, len(data), offset, vetted=vetted)
        payload = memoryview(data)[offset:]
        arrays = codec.decode_payload(payload, header, specs_checked=True)
        if finite and (bad := codec.first_nonfinite(payload, header["arrays"])) is not None:
            raise EntryFormatError(f"{bad} contains NaN or Inf")
        return header, arrays

    def read_entry_into(
        self, key: str, target: Callable[[dict[str, JSON]], list[memoryview]]
    ) -> dict[str, JSON]:
        """Read one entry's arrays straight into caller-owned buffers, verifying everything.

        `target(spec)` returns, for each array spec in file order, writable byte views whose
        lengths add up to the array's size; the file's bytes land there without an intermediate
        copy. The payload checksum is computed over them (overlapped with the reads, see
        `pipeline`) and float arrays are scanned for NaN/Inf as they land, while the bytes are
        still in the CPU cache. Returns the header. If this raises, the buffers hold partial
        data and must be discarded.
        """

        def targets(specs: list[dict[str, JSON]]) -> Iterator[tuple[memoryview, Check | None]]:
            for spec in specs:
                views = target(spec)
                if sum(v.nbytes for v in views) != spec["nbytes"]:
                    raise EntryFormatError(f"array {spec['name']}: buffer size mismatch")
                check = codec.finite_check(str(spec["name"]), str(spec["dtype"]))
                for view in views:
                    yield view, check

        with self._open_entry(key, vetted=True) as (f, header):
            specs = header["arrays"]  # checked by `validate_header`
            digest = header.get("payload_sha256")
            disk_fault("read")
            read_verified(f, targets(specs), header["payload_bytes"], digest)
        return header

    def write_entry(
        self, key: str, head: bytes, arrays: tuple[HostArray, ...], job: Cancellable
    ) -> int:
        """Durably write one entry unless `job.cancelled` is set by the time it is complete.

        Returns the file size, or 0 if the write was cancelled. Raises OSError if any step
        fails, leaving no file behind (or one marked evicted, see `delete`).
        """
        tmp = self.dir / f"{TMP_PREFIX}{key}.{os.getpid()}.{next(self._tmp_counter)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            try:
                write_all(fd, head)
                disk_fault("write")
                for i, arr in enumerate(arrays):
                    if i == len(arrays) // 2:
                        fault_point("disk_write_kill")  # a crash with half the payload written
                    if arr.nbytes:
                        write_all(fd, codec.byte_view(arr.data))
                disk_fault("fsync")
                fsync_fd(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            with self.fs_lock:
                if job.cancelled:
                    tmp.unlink()
                    return 0
                disk_fault("rename")
                os.replace(tmp, self.path(key))
                self.undeleted.pop(key, None)  # a new file replaced one marked evicted
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        try:
            disk_fault("dirsync")
            fsync_path(self.dir)
        except OSError:
            self.delete(key)  # the rename may not last: the entry counts as not written
            raise
        return size

    def delete(self, key: str, *, durable: bool = False) -> bool:
        """Remove an entry file (under fs_lock, so no in-flight rename can resurrect it).

        Never raises for the disk's sake: the caller has already forgotten the entry. A file
        that cannot be deleted (EACCES, EIO) is marked evicted in its slot, so that start-up
        deletes it instead of indexing it, and deleting it is retried (`retry_deletions`)."""
        if self.read_only:
            return False
        self.headers.forget(key)
        with self.fs_lock:
            try:
                if not self._unlink(key):
                    return False
            except OSError as exc:
                if not self._gone(key):  # e.g. an entry whose queued write was cancelled
                    self._keep_undeleted(key, exc)
                return False
        if durable:
            with contextlib.suppress(OSError):
                fsync_path(self.dir)
        return True

    def retry_deletions(self) -> int:
        """Delete again the files that `delete` could not; returns how many are still left."""
        deleted = 0
        with self.fs_lock:
            keys = list(self.undeleted)
        for key in keys:
            with self.fs_lock:
                if key not in self.undeleted:
                    continue  # replaced by a new write meanwhile
                try:
                    deleted += self._unlink(key)
                except OSError:
                    continue
        left = len(self.undeleted)
        if deleted:
            self.sync_directory()
            if not left:
                self.log.info("prompt-cache deleted the files it could not delete before")
        return left

    def _unlink(self, key: str) -> bool:
        """Delete `key`'s file (caller holds fs_lock); False if it was not there. Raises any
        other OSError, keeping `key` in `undeleted` if it was."""
        try:
            disk_fault("unlink")
            self.path(key).unlink()
            found = True
        except FileNotFoundError:
            found = False
        self.undeleted.pop(key, None)
        return found

    def _gone(self, key: str) -> bool:
        """Whether `key`'s file is certainly not there (a stat that fails otherwise proves
        nothing: the file is then kept as undeleted)."""
        try:
            os.lstat(self._file(key))
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return False

    def _keep_undeleted(self, key: str, exc: OSError) -> None:
        """`key`'s file could not be deleted: mark it evicted (caller holds fs_lock) and keep it
        for `retry_deletions`. Logged when the first such file appears, not for every one."""
        if not self.undeleted:
            self.log.warning(
                "prompt-cache could not delete %s (%s); it is not used again and deletion "
                "is retried",
                key[:16],
                exc.strerror or exc,
            )
        else:
            self.log.debug("prompt-cache could not delete %s: %s", key[:16], exc)
        self.undeleted[key] = exc.strerror or str(exc)
        try:
            self._write_slot(key, Slot(flags=codec.FLAG_EVICTED), durable=True)
        except OSError as mark_exc:  # then only this run knows: see docs/crash-safety.md
            self.log.debug("prompt-cache could not mark %s evicted: %s", key[:16], mark_exc)

    def sync_directory(self) -> None:
        """fsync the directory (e.g. once after a batch of non-durable deletions)."""
        if not self.read_only:
            with contextlib.suppress(OSError):
                fsync_path(self.dir)

    def write_slot(self, key: str, slot: Slot, *, durable: bool = False) -> None:
        """Rewrite an entry's mutable slot in place (never creates the file); not the slot of
        a file marked evicted (see `delete`)."""
        if self.read_only:
            return
        with self.fs_lock:
            if key in self.undeleted:
                return
            self._write_slot(key, slot, durable=durable)

    def _write_slot(self, key: str, slot: Slot, *, durable: bool) -> None:
        try:
            fd = os.open(self.path(key), os.O_WRONLY)
        except FileNotFoundError:
            return
        try:
            os.pwrite(fd, slot.pack(), codec.SLOT_OFFSET)
            if durable:
                fsync_fd(fd)
        finally:
            os.close(fd)

    def usage(self) -> tuple[int, int] | None:
        """(total, free) bytes of the cache's file system (statvfs, on macOS too), or None if
        it cannot be asked."""
        try:
            found = shutil.disk_usage(self.dir if self.dir.exists() else self.root)
        except OSError:
            return None
        return found.total, found.free

    def free_bytes(self) -> int:
        usage = self.usage()
        return usage[1] if usage else 0
