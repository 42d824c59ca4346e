"""The ranks of one job and the few collectives the server needs, over `mx.distributed`.

MLX's backends (ring over TCP/Thunderbolt, JACCL over RDMA, MPI) carry only array
collectives, so rank 0's decisions travel as the bytes of a JSON document summed with
zeros from every other rank (mlx_lm.server shares its requests the same way, with pickle;
JSON here, because the collectives' ports take no authentication and a peer's bytes must never
become code). A small message costs one collective: it fits in a fixed-size first buffer.

No rank trusts a length a peer sends: a message's length header and a gather's sizes are
checked against `MAX_MESSAGE` before anything is allocated, and bytes that are not the JSON
rank 0 would send end the job like a lost peer (`read_length`, `read_sizes`, `read_json`).

No rank may wait forever. A peer that dies makes the ring backend raise; a peer that hangs
would leave the others blocked inside a collective, so every collective runs under a deadline
kept by a watchdog thread. Either way the process logs one line and exits, and `mlx.launch`
ends the other ranks, so the service manager restarts the whole job.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import mlx.core as mx

from mlx_kvserve.json_value import JSON

log = logging.getLogger("mlx_kvserve.distributed")
Raw = TypeVar("Raw")
Read = TypeVar("Read")

FIRST_BUFFER = 1024  # bytes: a length header and the start of the message, in one collective
HEADER = 8
# bytes: the longest message a peer may announce. Rank 0's largest is a turn with a new request
# (its prompt's ids and grammar: a few MiB for a context of a million tokens); longer is a
# corrupt or hostile peer, refused before anything is allocated.
MAX_MESSAGE = 256 << 20
DEFAULT_TIMEOUT = 30.0  # seconds a collective may take before the job is declared stuck
EXIT_PEER_LOST = 75  # EX_TEMPFAIL: the job should be restarted as a whole


def _exit_job(message: str) -> None:
    log.critical(message)
    logging.shutdown()
    os._exit(EXIT_PEER_LOST)


class PeerMessageError(RuntimeError):
    """A peer sent what no rank of this job would: a length out of bounds, bytes not JSON."""


def read_length(header: bytes, limit: int = MAX_MESSAGE) -> int:
    """The message length a `share`'s first buffer announces, refused past `limit`."""
    if len(header) != HEADER:
        raise PeerMessageError(f"a length header of {len(header)} bytes, not {HEADER}")
    n = int.from_bytes(header, "little")
    if n > limit:
        raise PeerMessageError(f"a message of {n} bytes announced (at most {limit})")
    return n


def read_sizes(sizes: list[int], limit: int = MAX_MESSAGE) -> list[int]:
    """A gather's per-rank sizes, each and all together within `limit`."""
    if any(n < 0 for n in sizes) or sum(sizes) > limit:
        raise PeerMessageError(f"gather sizes {sizes} out of bounds (0 to {limit} bytes in all)")
    return sizes


def read_json(data: bytes) -> JSON:
    """A peer's message; bytes that are not UTF-8 JSON are refused."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise PeerMessageError(f"a message that is not JSON ({exc})") from None


class Collective:
    """The job's ranks: `share` rank 0's decisions, `all_true` for votes, under deadlines."""

    def __init__(
        self,
        group: mx.distributed.Group,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        on_lost: Callable[[str], None] = _exit_job,
    ) -> None:
        self.group = group
        self.rank: int = group.rank()
        self.size: int = group.size()
        self.timeout = timeout
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._pending: tuple[str, float, float] | None = None  # (what, deadline, seconds)
        self._watchdog: threading.Thread | None = None

    @classmethod
    def join(cls, backend: str = "any", timeout: float = DEFAULT_TIMEOUT) -> Collective:
        """Join the job `mlx.launch` started (a job of one when there is none)."""
        return cls(mx.distributed.init(backend=backend), timeout=timeout)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    # -- collectives ---------------------------------------------------------------------------
    def share(self, message: JSON = None, what: str = "share") -> JSON:
        """Rank 0's `message` (JSON-serialisable) on every rank; the others pass None."""
        if not self.distributed:
            return message
        first = bytearray(FIRST_BUFFER)
        rest = b""
        if self.is_leader:
            data = json.dumps(message, separators=(",", ":")).encode()
            first[:HEADER] = len(data).to_bytes(HEADER, "little")
            head = data[: FIRST_BUFFER - HEADER]
            first[HEADER : HEADER + len(head)] = head
            rest = data[len(head) :]
        summed = self._sum(mx.array(memoryview(first), dtype=mx.uint8), what)
        raw = bytes(memoryview(summed))
        n = self._checked(read_length, raw[:HEADER], what)
        data = raw[HEADER : HEADER + min(n, FIRST_BUFFER - HEADER)]
        extra = n - len(data)
        if extra > 0:
            buf = mx.array(memoryview(bytearray(rest) if self.is_leader else bytearray(extra)))
            data += bytes(memoryview(self._sum(buf.astype(mx.uint8), what)))
        return self._checked(read_json, data, what)

    def gather(self, value: JSON, what: str = "gather") -> list[JSON]:
        """Every rank's `value` (JSON-serialisable), in rank order, on every rank: two
        collectives (the lengths, then each rank's bytes at its own offset)."""
        if not self.distributed:
            return [value]
        data = json.dumps(value, separators=(",", ":")).encode()
        lengths = mx.zeros((self.size,), dtype=mx.int32)
        lengths[self.rank] = len(data)
        summed = [int(n) for n in self._sum(lengths, what).tolist()]
        sizes = self._checked(read_sizes, summed, what)
        buf = bytearray(sum(sizes))
        start = sum(sizes[: self.rank])
        buf[start : start + len(data)] = data
        raw = bytes(memoryview(self._sum(mx.array(memoryview(buf), dtype=mx.uint8), what)))
        values, offset = [], 0
        for n in sizes:
            values.append(self._checked(read_json, raw[offset : offset + n], what))
            offset += n
        return values

    def all_true(self, flag: bool, what: str = "vote") -> bool:
        """True on every rank if `flag` is true on every rank."""
        if not self.distributed:
            return bool(flag)
        total = self._sum(mx.array([1 if flag else 0], dtype=mx.int32), what)
        return int(total.item()) == self.size

    def all_equal(self, value: str, what: str = "check") -> bool:
        """True on every rank if every rank holds the same `value` (a fingerprint)."""
        return self.all_true(self.share(value if self.is_leader else None, what) == value, what)

    def barrier(self, what: str = "barrier") -> None:
        self.all_true(True, what)

    def _sum(self, array: mx.array, what: str) -> mx.array:
        with self._deadline(what):
            try:
                out = mx.distributed.all_sum(array, group=self.group, stream=mx.cpu)
                mx.eval(out)
            except RuntimeError as exc:  # the ring backend: a peer closed its connection
                self._on_lost(f"rank {self.rank}: a peer left the job during {what} ({exc})")
                raise
        return out

    def _checked(self, read: Callable[[Raw], Read], raw: Raw, what: str) -> Read:
        """`read(raw)`, or the end of the job when a peer sent what no rank would."""
        try:
            return read(raw)
        except PeerMessageError as exc:
            message = f"rank {self.rank}: a peer sent {exc} during {what}; ending the job"
            self._on_lost(message)
            raise PeerMessageError(message) from None

    # -- deadlines -----------------------------------------------------------------------------
    def end_job(self, message: str) -> None:
        """This rank cannot go on (a peer lost, the ranks no longer agree): end the job."""
        self._on_lost(message)

    @contextmanager
    def deadline(self, what: str, timeout: float | None = None) -> Iterator[None]:
        """Work across the ranks (a forward pass) that must end within `timeout` seconds
        (the collectives' own by default), or the job ends."""
        with self._deadline(what, timeout):
            yield

    @contextmanager
    def _deadline(self, what: str, timeout: float | None = None) -> Iterator[None]:
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            outer = self._pending  # a collective inside a forward pass's deadline: the pass's
            if outer is None:
                self._pending = (what, time.monotonic() + limit, limit)
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="mlx-kvserve-collective-watchdog", daemon=True
                )
                self._watchdog.start()
        try:
            yield
        finally:
            if outer is None:
                with self._lock:
                    self._pending = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self._lock:
                pending = self._pending
            if pending is not None and time.monotonic() > pending[1]:
                what, _, limit = pending
                self._on_lost(
                    f"rank {self.rank}: no answer from a peer within {limit:g} s during {what}; "
                    "ending the job so every rank restarts"
                )
                return


__all__ = [
    "EXIT_PEER_LOST",
    "MAX_MESSAGE",
    "Collective",
    "PeerMessageError",
    "read_json",
    "read_length",
    "read_sizes",
]
