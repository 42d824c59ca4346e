"""The disk writer thread: bytes and file I/O only, never an MLX call.

It writes entries, rewrites their slots, and reads back entries that a restore took from disk,
so that the RAM tier gets its copy without the restore paying for a second one.

The engine thread turns arrays into host bytes and enqueues a `WriteJob`; this thread hashes
the payload, finishes the header, and writes the file durably. Jobs run in FIFO order, so a delta
is always renamed into place after its parent. Results go back through `completed`, which the
store drains on the engine thread (the writer never touches the index).

A failing disk (ENOSPC, EIO, EACCES, a read-only remount) is logged once; later jobs are still
attempted, so writes resume by themselves when the disk recovers, and the first success after a
failure is logged too. While the disk is full (the last write failed with ENOSPC), a write the
file system has no room for is skipped instead of started, until space returns. A delta whose
parent's write failed is not written either: it was queued while that write was still in
flight, and on disk it would be an orphan that start-up deletes (with everything later chained
on it). The store then keeps it in RAM only, and its next checkpoints chain to entries that are
on disk. The keys of failed writes are remembered only until the store has seen the failure
(`forget`), so a disk that keeps failing does not grow them. Files the disk tier could not
delete are deleted again from here every `retry_seconds`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from mlx_kvserve.cache import codec
from mlx_kvserve.cache.codec import HostArray, Slot
from mlx_kvserve.cache.disk import DiskTier
from mlx_kvserve.json_value import JSON


@dataclass(eq=False)
class WriteJob:
    key: str
    header: dict[str, JSON]  # complete except payload_sha256
    arrays: tuple[HostArray, ...]
    slot: Slot
    cancelled: bool = False  # set under DiskTier.fs_lock


@dataclass
class WriteResult:
    job: WriteJob
    ok: bool
    file_bytes: int = 0
    digest: str = ""
    error: str = ""
    errno: int | None = None  # of the OSError that failed it (ENOSPC: no room on the disk)


@dataclass
class LoadResult:
    """A payload read back from disk for the RAM tier (arrays None if the read failed)."""

    key: str
    digest: str = ""
    arrays: tuple[HostArray, ...] | None = None
    error: str = ""


@dataclass(eq=False)
class _LoadJob:
    key: str


@dataclass(eq=False)
class _SlotJob:
    key: str
    slot: Slot
    durable: bool = False


@dataclass(eq=False)
class _DirSyncJob:
    """fsync the directory once after several deletions (a failure eviction)."""


@dataclass(eq=False)
class _Forget:
    """The store has seen `key`'s failed write (see `Writer.forget`)."""

    key: str


@dataclass
class WriterStats:
    bytes_written: int = 0
    files_written: int = 0
    write_errors: int = 0
    write_skips: int = 0  # not attempted: the disk was full and still had no room for them
    slot_errors: int = 0
    failing: bool = False
    last_error: str = ""
    last_errno: int | None = None
    errors_by_kind: dict[str, int] = field(default_factory=dict)


_STOP = object()  # the item that ends the thread
_Job = WriteJob | _LoadJob | _SlotJob | _DirSyncJob | _Forget | object  # object: _STOP


class Writer:
    def __init__(self, disk: DiskTier, log: logging.Logger, *, retry_seconds: float = 30.0) -> None:
        self.disk = disk
        self.log = log
        self.retry_seconds = retry_seconds  # between attempts to delete `disk.undeleted`
        self.stats = WriterStats()
        self.completed: deque[WriteResult | LoadResult] = deque()
        self._unwritten: set[str] = set()  # keys whose write failed (writer thread only)
        self._retried_at = time.monotonic()
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._progress = threading.Condition()  # notified after every job
        self._thread = threading.Thread(target=self._run, name="kvcache-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob) -> None:
        self._queue.put(job)

    def submit_slot(self, key: str, slot: Slot, *, durable: bool = False) -> None:
        self._queue.put(_SlotJob(key, Slot(slot.hits, slot.last_used, slot.flags), durable))

    def submit_load(self, key: str) -> None:
        """Read an entry's payload (fully verified) and report it as a `LoadResult`."""
        self._queue.put(_LoadJob(key))

    def submit_dir_sync(self) -> None:
        """Make earlier deletions durable with one directory fsync, off the engine thread."""
        self._queue.put(_DirSyncJob())

    def forget(self, key: str) -> None:
        """The store has applied `key`'s failed write: no job it queues from now on chains to
        `key`, and the jobs queued before run first, so once the writer reaches this item the
        key need not be remembered (the store's calls keep `_unwritten` bounded)."""
        if self._thread.is_alive():
            self._queue.put(_Forget(key))

    @property
    def unwritten(self) -> int:
        """How many failed writes the writer still remembers (0 once the store saw them)."""
        return len(self._unwritten)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def wait_progress(self, timeout: float) -> None:
        """Block until the writer finishes a job (or `timeout` seconds pass)."""
        if not self._thread.is_alive():
            return
        with self._progress:
            self._progress.wait(timeout)

    def flush(self) -> None:
        """Block until every queued job has been handled."""
        if self._thread.is_alive():
            self._queue.join()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    # -- thread body ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            wait = self.retry_seconds if self.disk.undeleted else None
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                self._retry_deletions()
                continue
            try:
                if item is _STOP:
                    return
                if isinstance(item, _SlotJob):
                    self._write_slot(item)
                elif isinstance(item, _LoadJob):
                    self.completed.append(self._load(item))
                elif isinstance(item, _DirSyncJob):
                    self.disk.sync_directory()
                elif isinstance(item, _Forget):
                    self._unwritten.discard(item.key)
                else:
                    self.completed.append(self._write(item))
                if self.disk.undeleted:
                    self._retry_deletions()
            except Exception:  # pragma: no cover - keep the thread alive no matter what
                self.log.exception("prompt-cache writer: unexpected error")
            finally:
                self._queue.task_done()
                with self._progress:
                    self._progress.notify_all()

    def _retry_deletions(self) -> None:
        if time.monotonic() - self._retried_at >= self.retry_seconds:
            self._retried_at = time.monotonic()
            self.disk.retry_deletions()

    def _write(self, job: WriteJob) -> WriteResult:
        if job.cancelled:
            return WriteResult(job, False, error="cancelled")
        if job.header.get("parent") in self._unwritten:
            self._unwritten.add(job.key)
            self.log.debug("prompt-cache write of %s skipped: parent not written", job.key[:16])
            return WriteResult(job, False, error="parent entry was not written")
        try:
            digest = codec.payload_digest(job.arrays)
            header = dict(job.header, payload_sha256=digest)
            head = codec.pack_head(header, job.slot)
            if self._no_room(len(head) + sum(a.nbytes for a in job.arrays)):
                self._unwritten.add(job.key)
                self.stats.write_skips += 1
                return WriteResult(job, False, error="the disk is full", errno=errno.ENOSPC)
            size = self.disk.write_entry(job.key, head, job.arrays, job)
        except OSError as exc:
            self._unwritten.add(job.key)
            self._failed(job, exc)
            return WriteResult(job, False, error=f"{type(exc).__name__}: {exc}", errno=exc.errno)
        except Exception as exc:  # a bug or bad data: never let it kill the writer
            self._unwritten.add(job.key)
            self.log.exception("prompt-cache write of %s failed", job.key[:16])
            return WriteResult(job, False, error=f"{type(exc).__name__}: {exc}")
        if size == 0:
            return WriteResult(job, False, error="cancelled")
        self._unwritten.discard(job.key)
        if self.stats.failing:
            self.stats.failing, self.stats.last_errno = False, None
            self.log.info("prompt-cache disk writes resumed")
        self.stats.bytes_written += size
        self.stats.files_written += 1
        return WriteResult(job, True, size, digest)

    def _no_room(self, nbytes: int) -> bool:
        """While the disk is full, is there still no room for a file of `nbytes`? (A statvfs
        per write, instead of starting one that fails.)"""
        if not self.stats.failing or self.stats.last_errno != errno.ENOSPC:
            return False
        usage = self.disk.usage()
        return usage is not None and usage[1] < nbytes

    def _load(self, job: _LoadJob) -> LoadResult:
        try:
            header, arrays = self.disk.read_entry(job.key)
        except Exception as exc:  # evicted meanwhile, or damaged: the next restore will tell
            self.log.debug("prompt-cache read-back of %s failed: %s", job.key[:16], exc)
            return LoadResult(job.key, error=str(exc))
        return LoadResult(job.key, str(header.get("payload_sha256", "")), tuple(arrays))

    def _failed(self, job: WriteJob, exc: OSError) -> None:
        self.stats.write_errors += 1
        kind = getattr(exc, "strerror", None) or type(exc).__name__
        self.stats.errors_by_kind[kind] = self.stats.errors_by_kind.get(kind, 0) + 1
        self.stats.last_error = f"{kind}"
        self.stats.last_errno = exc.errno
        if not self.stats.failing:
            self.stats.failing = True
            self.log.warning(
                "prompt-cache disk write failed (%s); skipping disk writes and serving from RAM "
                "until a write succeeds again",
                exc,
            )
        else:
            self.log.debug("prompt-cache write of %s skipped: %s", job.key[:16], exc)

    def _write_slot(self, job: _SlotJob) -> None:
        try:
            self.disk.write_slot(job.key, job.slot, durable=job.durable)
        except OSError as exc:
            self.stats.slot_errors += 1
            with contextlib.suppress(Exception):
                self.log.debug("prompt-cache slot update of %s failed: %s", job.key[:16], exc)
