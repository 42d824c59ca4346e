"""Stopping the engine: graceful drain, cancellation, joining its thread. A mixin of `Engine`.

Kept apart from the serving loop (engine/worker.py) because it is a different job: refusing new
work, ending whatever is queued, held, paused, prefilling or decoding with a clear event, and
flushing the prompt cache once the engine thread has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable

from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.generate import PrefillTask
from mlx_kvserve.engine.lockstep import Turn
from mlx_kvserve.engine.namespaces import Caches
from mlx_kvserve.engine.requests import STOP, EngineError, GenerationRequest
from mlx_kvserve.engine.room import Room
from mlx_kvserve.engine.schedule import Scheduler
from mlx_kvserve.engine.waitlist import WaitQueue


class Stopping:
    """`drain`, `stop` and `stop_async` for `Engine` (which defines the attributes used)."""

    _queue: WaitQueue
    _thread: threading.Thread
    _draining: threading.Event
    _stopping: threading.Event
    _held: GenerationRequest | None
    batch: DecodeBatch | None
    room: Room | None
    schedule: Scheduler
    prompt_cache: Caches
    _start_turn: Callable[[], Turn]
    _step: Callable[[Turn], None]
    _advance: Callable[[PrefillTask, Turn], None]
    _end_paused: Callable[[], None]
    _end_unstarted: Callable[[GenerationRequest], None]
    _log_unstarted: Callable[[GenerationRequest, str], None]

    def _active(self) -> list[GenerationRequest]:
        """Requests the engine has taken: held for room, prefilling, decoding (any thread)."""
        batch = self.batch
        active = list(batch.requests) if batch is not None else []
        active += [task.req for task in self.schedule]
        active += [seq.req for seq, _ in (self.room.paused if self.room is not None else ())]
        return active + ([self._held] if isinstance(self._held, GenerationRequest) else [])

    def drain(self, grace: float) -> None:
        """Graceful shutdown: refuse new work now; after `grace` seconds cancel what remains.

        Cancelled streams end with an error event and `[DONE]`, so their connections close and
        the HTTP server can finish shutting down without tearing down live tasks.
        """
        self._draining.set()
        timer = threading.Timer(grace, self._cancel_all)
        timer.daemon = True
        timer.start()

    def _cancel_all(self) -> None:
        self._refuse_queued()
        for req in self._active():
            req.cancel()

    def _refuse_queued(self) -> None:
        """Whatever is still queued ends with the shutdown's error, each with its log line
        (`finish=shutdown`): every request the server took shows in the log."""
        for req in self._queue.drain():
            self._log_unstarted(req, "shutdown")
            req.emit(EngineError("the server is shutting down"))

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new work, fail queued requests, cancel the running one, join the thread."""
        self._signal_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._close_cache()

    async def stop_async(self, timeout: float = 30.0) -> None:
        """`stop()` without blocking the event loop while the thread finishes and the cache
        flushes its writes (up to `timeout` seconds at shutdown)."""
        self._signal_stop()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout)
        await asyncio.to_thread(self._close_cache)

    def _signal_stop(self) -> None:
        self._stopping.set()
        self._cancel_all()
        with contextlib.suppress(queue.Full):  # drained just above
            self._queue.put_nowait(STOP)

    def _close_cache(self) -> None:
        if self.prompt_cache is not None and not self._thread.is_alive():
            self.prompt_cache.close()  # flush pending checkpoint writes, mark a clean exit

    def _shut_down(self) -> None:
        """Stopping: whatever is queued, held or decoding ends now."""
        assert self.batch is not None
        for req in self._active():
            req.cancel_now()
        self._end_paused()
        if self._held is not None:
            self._end_unstarted(self._held)
            self._held = None
        while self.batch:  # every rank of a job ends them alike, turn by turn
            with self._start_turn() as turn:
                self._step(turn)
        for task in self.schedule:  # each ends at its next check, cancelled
            while task in self.schedule.tasks:
                with self._start_turn() as turn:
                    self._advance(task, turn)
        self._refuse_queued()
        for req in self._queue.take_cancelled():  # their clients left while they were queued
            self._end_unstarted(req)
