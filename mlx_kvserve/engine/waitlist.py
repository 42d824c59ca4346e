"""The engine's request queue, where a cancelled request gives up its place at once.

A client that disconnects while its request waits cancels it; with a plain `queue.Queue` the
request still held a slot until the engine reached it, so a burst of departed clients made the
server answer 503 to the next real one while nobody was waiting. Here cancelled requests do not
count towards the size limit (or `qsize()`, which /health reports) and are skipped by `get()`.
A skipped request is set aside, not lost: the engine thread takes it with `take_cancelled()`
and ends it (its Done and its log line), as it ends one cancelled while held for room.
"""

from __future__ import annotations

import queue
from typing import TypeGuard

from mlx_kvserve.engine.requests import GenerationRequest, Item


def _cancelled(item: Item) -> TypeGuard[GenerationRequest]:
    return isinstance(item, GenerationRequest) and item.cancelled.is_set()


class WaitQueue(queue.Queue[Item]):
    """A FIFO `queue.Queue` whose size counts only requests that are still wanted."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self._left: list[GenerationRequest] = []  # cancelled while queued, not yet ended

    def _prune(self) -> None:
        if any(_cancelled(item) for item in self.queue):
            self._left += [item for item in self.queue if _cancelled(item)]
            kept = [item for item in self.queue if not _cancelled(item)]
            self.queue.clear()
            self.queue.extend(kept)

    def take_cancelled(self) -> list[GenerationRequest]:
        """The requests cancelled while queued since the last call, in queue order: never
        handed out by `get()`, so the engine must still end each one."""
        with self.mutex:
            self._prune()
            left, self._left = self._left, []
            return left

    def _qsize(self) -> int:
        self._prune()
        return len(self.queue)

    def _get(self) -> Item:
        self._prune()
        return self.queue.popleft()

    def waiting(self) -> int:
        """Requests (and STOP) queued: what /health and the size limit count, wakes left out."""
        with self.mutex:
            self._prune()
            return sum(item is not None for item in self.queue)

    def wake(self) -> None:
        """End an idle engine's wait for a request now (a `call()` came for its thread): a None
        item, "no request", which `waiting()` does not count; one is enough while queued."""
        with self.not_empty:
            if any(item is None for item in self.queue):
                return
            self.queue.append(None)
            self.unfinished_tasks += 1
            self.not_empty.notify()

    def drain(self) -> list[GenerationRequest]:
        """Take every queued request out (the engine stops or failed: each gets its error)."""
        taken = []
        while True:
            try:
                item = self.get_nowait()
            except queue.Empty:
                return taken
            if isinstance(item, GenerationRequest):
                taken.append(item)
