"""The engine side of the writer thread: queue writes and read-backs, apply their results.

The writer thread never touches the catalog; it reports through `Writer.completed`, which
`apply_writer_results` drains on the engine thread under the cache's lock. An entry is
`DISK_PENDING` from `queue_write` until its result arrives; its host copy stays reachable
through `Catalog.pending` until then, so a restore can use it before it lands.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence

from mlx_kvserve.cache.catalog import Catalog, slot_of
from mlx_kvserve.cache.codec import HostArray
from mlx_kvserve.cache.entry import DISK_NONE, DISK_PENDING, DISK_WRITTEN, Entry
from mlx_kvserve.cache.writer import LoadResult, WriteJob
from mlx_kvserve.json_value import JSON

AdmitToRam = Callable[[str, Sequence[HostArray]], None]


def queue_write(
    catalog: Catalog,
    entry: Entry,
    header: dict[str, JSON],
    arrays: Sequence[HostArray],
    file_bytes: int,
) -> None:
    """Hand a new entry's file to the writer thread; its bytes count from now on."""
    assert catalog.writer is not None
    job = WriteJob(entry.key, header, tuple(arrays), slot_of(entry))
    entry.disk = DISK_PENDING
    entry.file_bytes = file_bytes
    catalog.disk_bytes += file_bytes
    catalog.pending[entry.key] = job
    catalog.writer.submit(job)
    catalog.counters["bytes_queued"] += file_bytes


def request_readback(catalog: Catalog, links: Sequence[Entry]) -> None:
    """Have the writer thread read disk-restored links back into the RAM tier."""
    if catalog.writer is None:
        return
    for link in links:
        if link.key not in catalog.ram and link.payload_bytes <= catalog.ram.budget:
            catalog.writer.submit_load(link.key)


def apply_writer_results(catalog: Catalog, admit_to_ram: AdmitToRam) -> bool:
    """Apply the writer thread's results (engine thread, under the lock). True if a write
    finished: its copy is no longer pinned in memory by the queue."""
    if catalog.writer is None:
        return False
    completed = catalog.writer.completed
    wrote = False
    while completed:
        result = completed.popleft()
        if isinstance(result, LoadResult):
            _read_back(catalog, result, admit_to_ram)
            continue
        job = result.job
        wrote = True
        if catalog.pending.get(job.key) is job:
            del catalog.pending[job.key]
        if not result.ok:
            # Seen here: no job queued from now on chains to it. A cancelled one too: its write
            # may have failed after its entry was evicted, and the writer remembered it.
            catalog.writer.forget(job.key)
            if not job.cancelled:
                catalog.counters["disk_full"] += result.errno == errno.ENOSPC
        entry = catalog.entries.get(job.key)
        if entry is None or job.cancelled or entry.disk != DISK_PENDING:
            continue
        if result.ok:
            entry.disk = DISK_WRITTEN
            catalog.disk_bytes += result.file_bytes - entry.file_bytes
            entry.file_bytes = result.file_bytes
            entry.digest = result.digest
        else:
            entry.disk = DISK_NONE
            catalog.disk_bytes -= entry.file_bytes
            entry.file_bytes = 0
            if entry.key not in catalog.ram:
                # Its bytes lived only in the failed job: the entry cannot be served.
                catalog.remove_tree(entry.key)
    return wrote


def _read_back(catalog: Catalog, result: LoadResult, admit_to_ram: AdmitToRam) -> None:
    """Put a payload the writer read back (see `request_readback`) into the RAM tier, unless
    the entry changed or went away meanwhile."""
    entry = catalog.entries.get(result.key)
    if (
        result.arrays is None
        or entry is None
        or entry.disk != DISK_WRITTEN
        or result.key in catalog.ram
        or (entry.digest is not None and result.digest != entry.digest)
    ):
        return
    admit_to_ram(result.key, result.arrays)
