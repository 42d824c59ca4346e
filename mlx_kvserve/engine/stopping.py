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
from typing import Any

from mlx_kvserve.engine.requests import EngineError, GenerationRequest

STOP = object()  # the queue item that stops the engine thread


class Stopping:
    """`drain`, `stop` and `stop_async` for `Engine` (which defines the attributes used)."""

    _queue: Any
    _thread: threading.Thread
    _draining: threading.Event
    _stopping: threading.Event
    _held: Any
    batch: Any
    schedule: Any
    prompt_cache: Any
    lockstep: Any

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
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(pending, GenerationRequest):
                pending.emit(EngineError("the server is shutting down"))
        for req in self._active():
            req.cancel()

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
            self._start_turn()
            self._step()
            self.lockstep.flush()
        for task in self.schedule:  # each ends at its next check, cancelled
            while task in self.schedule.tasks:
                self._start_turn()
                self._advance(task)
                self.lockstep.flush()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, GenerationRequest):
                item.emit(EngineError("the server is shutting down"))
