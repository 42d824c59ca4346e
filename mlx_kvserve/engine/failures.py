"""When a turn of the engine loop fails: the requests it touched fail, the engine goes on, or,
when it cannot, it stops and says why. A mixin of `Engine` (engine/worker.py).

Every turn runs under one guard (`Engine._loop`). An exception anywhere in a turn (admission,
a resumption, the scheduler, the memory plan before a decode step, a pause) fails the requests
the turn touched with a clean error event, takes them out of wherever they were (held for
room, prefilling, decoding, paused) and releases their KV holds. Then a sweep fails any request
the engine had taken that is no longer anywhere (so no stream waits forever) and drops any hold
whose request has ended (so admission never counts memory no one holds).

The engine cannot go on when a failure touched no request three turns in a row (it would fail
the same way forever), when cleaning up fails too, or in a job across machines (its ranks
would no longer be known to step alike). It then stops: `failure` says why (`/health` answers
503 with it, `submit` refuses at once), and every request it held or queued gets its error.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable

from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.calls import CallQueue
from mlx_kvserve.engine.intake import EngineNotReady
from mlx_kvserve.engine.live import Timings
from mlx_kvserve.engine.lockstep import Agreement
from mlx_kvserve.engine.requests import EngineError, GenerationRequest
from mlx_kvserve.engine.room import Room
from mlx_kvserve.engine.schedule import Scheduler
from mlx_kvserve.engine.waitlist import WaitQueue

log = logging.getLogger("mlx_kvserve.engine")

BLAMELESS_TURNS = 3  # failed turns in a row that touched no request: the engine stops


class Failures:
    """`_recover` and `_die` for `Engine`, which defines the attributes used."""

    _queue: WaitQueue
    _thread: threading.Thread
    _stopping: threading.Event
    _intake: threading.Lock
    _calls: CallQueue
    _held: GenerationRequest | None
    _inflight: dict[str, GenerationRequest]
    _touched: list[GenerationRequest]
    ready: threading.Event
    batch: DecodeBatch | None
    schedule: Scheduler
    room: Room | None
    lockstep: Agreement
    _release: Callable[[GenerationRequest], None]
    _observe: Callable[[GenerationRequest, Timings | None], None]

    _failure: str | None = None
    _blameless = 0  # failed turns in a row that touched no request

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving when it should not have (None: it serves, loads, or
        was stopped on purpose)."""
        if self._failure is not None or self._stopping.is_set() or not self.ready.is_set():
            return self._failure
        return None if self._thread.is_alive() else "the engine thread stopped"

    def _failed(self, reqs: list[GenerationRequest]) -> None:
        """`reqs` end with an error event (inside the `except` that caught why)."""
        if not reqs:
            return
        log.error(
            "request %s failed:\n%s",
            ", ".join(r.request_id for r in reqs),
            traceback.format_exc(),
        )
        for req in reqs:
            self._release(req)
            self._observe(req, None)
            req.emit(EngineError("internal error while generating; see the server log"))

    def _recover(self, error: Exception) -> bool:
        """A turn raised `error` (inside its `except`): fail what it touched and sweep; whether
        the engine goes on (else it has stopped, see `_die`)."""
        log.error("a turn of the engine loop failed:\n%s", traceback.format_exc())
        if self.lockstep.distributed:
            self._die(f"{type(error).__name__}: {error} (in a turn of a job across machines)")
            return False
        try:
            blamed = self._fail_touched() + self._sweep()
        except Exception as again:
            log.exception("cleaning up after the failed turn failed too")
            self._die(f"the engine could not recover from {error!r}: {again!r}")
            return False
        self._blameless = 0 if blamed else self._blameless + 1
        if self._blameless >= BLAMELESS_TURNS:
            self._die(f"{self._blameless} turns in a row failed: {error!r}")
            return False
        return True

    def _fail_touched(self) -> list[GenerationRequest]:
        """The requests the failed turn touched fail (a touched row of the batch: the whole
        batch, whose state is unknown); the ones that had not ended yet."""
        touched = {r.request_id: r for r in self._touched if r.request_id in self._inflight}
        batch = self.batch
        if batch is not None and any(r.request_id in touched for r in batch.requests):
            touched.update((seq.req.request_id, seq.req) for seq in batch.fail_all())
        reqs = list(touched.values())
        self._remove(reqs)
        self._failed(reqs)
        return reqs

    def _sweep(self) -> list[GenerationRequest]:
        """Requests the engine took that are nowhere now fail; holds of ended requests go."""
        batch, room = self.batch, self.room
        found = {task.req.request_id for task in self.schedule}
        found |= {req.request_id for req in (batch.requests if batch is not None else [])}
        found |= {seq.req.request_id for seq, _ in (room.paused if room is not None else [])}
        if self._held is not None:
            found.add(self._held.request_id)
        lost = [req for rid, req in self._inflight.items() if rid not in found]
        if lost:
            log.error("requests %s were lost by the failed turn", [r.request_id for r in lost])
            self._failed(lost)
        if room is not None:
            ended = {rid for rid in room.ledger.holds if rid not in self._inflight}
            if ended:
                room.forget({str(rid) for rid in ended})
        return lost

    def _remove(self, reqs: list[GenerationRequest]) -> None:
        """`reqs` leave the places a request waits or runs in (the batch is the caller's)."""
        ids = {req.request_id for req in reqs}
        if self._held is not None and self._held.request_id in ids:
            self._held = None
        for task in self.schedule:
            if task.req.request_id in ids:
                self.schedule.remove(task)
        if self.room is not None:
            self.room.forget(ids)

    def _die(self, cause: str) -> None:
        """The engine cannot go on: refuse new requests from now on, end every request it
        holds or has queued with an error, fail the calls waiting for it."""
        with self._intake:  # `submit` either queued before this or sees the failure
            self._failure = cause
        log.error("the engine stopped: %s", cause)
        error = EngineError(f"the server's engine stopped: {cause}; see the server log")
        reqs = list(self._inflight.values())
        self._inflight.clear()
        self._held = None
        self.schedule.tasks.clear()
        if self.batch is not None:
            self.batch.fail_all()
        if self.room is not None:
            self.room.paused.clear()
            self.room.ledger.holds.clear()
        for req in reqs + self._queue.drain() + self._queue.take_cancelled():
            self._observe(req, None)
            req.emit(error)
        self._calls.fail_all(EngineNotReady(cause))


__all__ = ["BLAMELESS_TURNS", "Failures"]
