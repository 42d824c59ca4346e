"""How requests come in: queued from the event loop, taken by the engine thread when there is
room. A mixin of `Engine` (engine/worker.py).

`submit` (event loop) refuses at once what could never be served (the engine is loading,
stopping or has failed; the queue is full; a prompt no KV budget could hold) and queues the
rest. The engine thread takes the next request when there is room by count and by KV memory
(engine/room.py), holding it at the head of the line meanwhile. A request whose client leaves
while it waits ends there, holding nothing: it is never admitted, so no reservation is left
behind; one that leaves while still queued gives its place back at once (engine/waitlist.py)
and is ended at the engine's next turn. Either way it gets its Done and its log line.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from mlx_kvserve.engine import faults
from mlx_kvserve.engine.live import Timings
from mlx_kvserve.engine.lockstep import Agreement
from mlx_kvserve.engine.requests import STOP, CancelLatch, Done, GenerationRequest, Item
from mlx_kvserve.engine.room import Room
from mlx_kvserve.engine.waitlist import WaitQueue

log = logging.getLogger("mlx_kvserve.engine")

IDLE_POLL = 0.05  # seconds: how often an idle engine looks for work (a call() wakes it at once)


class EngineNotReady(Exception):
    """The model is still loading, failed to load, or the engine stopped."""


class EngineBusy(Exception):
    """The request queue is full."""


class RequestTooLarge(Exception):
    """The request's prompt could never fit in the KV budget, even alone; the message says why."""


class Intake:
    """`submit` and the engine thread's `_take` for `Engine` (which defines the attributes)."""

    _queue: WaitQueue
    _held: GenerationRequest | None
    _inflight: dict[str, GenerationRequest]
    _touched: list[GenerationRequest]
    _draining: threading.Event
    _stopping: threading.Event
    _intake: threading.Lock
    ready: threading.Event
    load_error: str | None
    room: Room | None
    lockstep: Agreement
    running: int
    max_concurrency: int
    failure: str | None
    _busy: Callable[[], bool]
    _release: Callable[[GenerationRequest], None]
    _observe: Callable[[GenerationRequest, Timings | None], None]

    @property
    def queued(self) -> int:
        return self._queue.waiting() + isinstance(self._held, GenerationRequest)

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request for the engine thread; raises instead of waiting when it cannot."""
        if self._draining.is_set() or self._stopping.is_set():
            raise EngineNotReady("the server is shutting down")
        if not self.ready.is_set():
            raise EngineNotReady(self.load_error or "the model is still loading")
        if self.room is not None and not self.room.fits_alone(req):
            raise RequestTooLarge(self.room.too_large(req))
        with self._intake:
            failure = self.failure
            if failure is not None:
                raise EngineNotReady(f"the server's engine stopped: {failure}")
            if self.queued >= self._queue.maxsize:  # the request held for room counts too
                raise EngineBusy
            if self.lockstep.distributed:  # a client's cancel takes effect at a turn's start
                latch = CancelLatch()
                if req.cancelled.is_set():
                    latch.set()
                req.cancelled = latch
            try:
                self._queue.put_nowait(req)
            except queue.Full:
                raise EngineBusy from None

    def _take(self) -> Item:
        """Rank 0's (or a lone engine's) next item: STOP, a request that has room, or None."""
        return STOP if self._stopping.is_set() else self._next()

    def _next(self) -> Item:
        """The next request if there is room for it, STOP, or None (run work / idle)."""
        left = self._queue.take_cancelled()  # gave up while queued: never handed out
        self._inflight.update((req.request_id, req) for req in left)
        self._touched += left  # (a failure here fails them: they still end)
        for req in left:
            self._end_unstarted(req)
        if self._held is None:
            if self._busy() and not self._can_join():
                return None  # full by count: leave the queue as it is
            try:
                if self._busy():
                    item = self._queue.get_nowait()
                else:
                    item = self._queue.get(timeout=IDLE_POLL)
            except queue.Empty:
                return None
            if not isinstance(item, GenerationRequest):
                return item
            self._held = self._inflight[item.request_id] = item
        req = self._held
        self._touched.append(req)
        if req.cancelled.is_set():  # gave up while waiting: it holds nothing yet
            self._held = None
            self._end_unstarted(req)
            return None
        if not self._has_room(req):
            return None
        self._held = None
        return req

    def _can_join(self) -> bool:
        """Room by count. A model that decodes one at a time takes requests all the same: their
        lookups, restores and prefills run beside the one decoding (the batch holds them)."""
        return self.running < self.max_concurrency

    def _has_room(self, req: GenerationRequest) -> bool:
        assert self.room is not None
        if self._busy() and not self._can_join():
            return False
        faults.maybe_fail("admission")
        return self.room.admit(req, self._busy())

    def _end_unstarted(self, req: GenerationRequest) -> None:
        """End a request that never reached the generator (cancelled while queued or held):
        it still gets its log line, so every request the server took shows in the log."""
        self._release(req)
        self._observe(req, None)
        self._log_unstarted(req, "cancelled")
        req.emit(Done("cancelled", len(req.prompt_tokens), 0, 0))

    def _log_unstarted(self, req: GenerationRequest, finish: str) -> None:
        """The log line of a request that ends before it reached the generator."""
        timings = Timings(prompt_tokens=len(req.prompt_tokens), finish_reason=finish)
        log.info(timings.log_line(req))


__all__ = ["EngineBusy", "EngineNotReady", "Intake", "RequestTooLarge"]
