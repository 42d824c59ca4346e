"""The disk writer thread: bytes and file I/O only, never an MLX call.

It writes entries, rewrites their slots, and reads back entries that a restore took from disk,
so that the RAM tier gets its copy without the restore paying for a second one.

The engine thread turns arrays into host bytes and enqueues a `WriteJob`; this thread hashes
the payload, finishes the header, and writes the file durably. Jobs run in FIFO order, so a delta
is always renamed into place after its parent. Results go back through `completed`, which the
store drains on the engine thread (the writer never touches the index).

A failing disk (ENOSPC, EIO, a read-only remount) is logged once; later jobs are still
attempted, so writes resume by themselves when space returns, and the first success after a
failure is logged too. A delta whose parent's write failed is not written either: it was queued
while that write was still in flight, and on disk it would be an orphan that start-up deletes
(with everything later chained on it). The store then keeps it in RAM only, and its next
checkpoints chain to entries that are on disk.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mlx_kvserve.cache import codec
from mlx_kvserve.cache.codec import HostArray, Slot
from mlx_kvserve.cache.disk import DiskTier


@dataclass(eq=False)
class WriteJob:
    key: str
    header: dict[str, Any]  # complete except payload_sha256
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


@dataclass
class WriterStats:
    bytes_written: int = 0
    files_written: int = 0
    write_errors: int = 0
    slot_errors: int = 0
    failing: bool = False
    last_error: str = ""
    errors_by_kind: dict[str, int] = field(default_factory=dict)


_STOP = object()


class Writer:
    def __init__(self, disk: DiskTier, log: logging.Logger) -> None:
        self.disk = disk
        self.log = log
        self.stats = WriterStats()
        self.completed: deque[WriteResult | LoadResult] = deque()
        self._unwritten: set[str] = set()  # keys whose write failed (writer thread only)
        self._queue: queue.Queue[Any] = queue.Queue()
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
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, _SlotJob):
                    self._write_slot(item)
                elif isinstance(item, _LoadJob):
                    self.completed.append(self._load(item))
                elif isinstance(item, _DirSyncJob):
                    self.disk.sync_directory()
                else:
                    self.completed.append(self._write(item))
            except Exception:  # pragma: no cover - keep the thread alive no matter what
                self.log.exception("prompt-cache writer: unexpected error")
            finally:
                self._queue.task_done()
                with self._progress:
                    self._progress.notify_all()

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
            size = self.disk.write_entry(job.key, head, job.arrays, job)
        except OSError as exc:
            self._unwritten.add(job.key)
            self._failed(job, exc)
            return WriteResult(job, False, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug or bad data: never let it kill the writer
            self._unwritten.add(job.key)
            self.log.exception("prompt-cache write of %s failed", job.key[:16])
            return WriteResult(job, False, error=f"{type(exc).__name__}: {exc}")
        if size == 0:
            return WriteResult(job, False, error="cancelled")
        self._unwritten.discard(job.key)
        if self.stats.failing:
            self.stats.failing = False
            self.log.info("prompt-cache disk writes resumed")
        self.stats.bytes_written += size
        self.stats.files_written += 1
        return WriteResult(job, True, size, digest)

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
