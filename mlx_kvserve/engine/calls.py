"""Work other threads hand to the engine thread: MLX objects belong to the thread that made them.

The /v1/cache figures, tests' probes and anything else that touches the prompt cache or MLX run
as a call on the engine thread, between two pieces of its work (a decode step, a prefill chunk)
or at once when it is idle (`Engine.call` wakes its wait for requests). The caller gets a
`Future`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import mlx.nn as nn

T = TypeVar("T")


class EngineCalls(Protocol):
    """What work run between the engine's steps asks of it (engine/worker.py's `Engine`): the
    embedding batcher (embed/batcher.py), the prompt scorer (engine/scorer.py)."""

    @property
    def model(self) -> nn.Module | None: ...

    @property
    def tokenizer(self) -> object: ...

    @property
    def running(self) -> int: ...

    @property
    def queued(self) -> int: ...

    def call(self, fn: Callable[[], T]) -> Future[T]: ...


class CallQueue:
    """Calls waiting for the engine thread, run in order by `run()` on that thread."""

    def __init__(self) -> None:
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()

    def put(self, fn: Callable[[], T], refuse: Exception | None = None) -> Future[T]:
        """Queue `fn`; with `refuse` (the engine is not running) the future fails at once."""
        future: Future[T] = Future()
        if refuse is not None:
            future.set_exception(refuse)
        else:
            self._calls.append((fn, future))
        return future

    def run(self) -> None:
        """Run the calls queued so far (one queued by a call runs at the next boundary)."""
        for _ in range(len(self._calls)):
            fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller gets it; the engine carries on
                future.set_exception(exc)

    def fail_all(self, error: Exception) -> None:
        """The engine stopped: every call still waiting fails with `error`."""
        while self._calls:
            _, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(error)


class BetweenSteps:
    """Work queued for the engine thread and run between generation's steps, a slice at a time
    (the embedding batcher, the prompt scorer): one engine call queued at most; while the engine
    generates a call runs one slice of at most `busy_tokens` positions, while it is idle slices
    of `idle_tokens` go on back to back. If the engine refuses the call (it stopped), every
    waiting job fails with its error.

    A subclass says whether work waits (`_has_work`, under the lock), runs a slice (`_slice`,
    ENGINE THREAD: whether there was one) and hands over what waits when the engine refuses
    (`_take_all`, under the lock: the jobs' futures)."""

    def __init__(self, engine: EngineCalls, busy_tokens: int, idle_tokens: int) -> None:
        self.engine = engine
        self.busy_tokens = busy_tokens
        self.idle_tokens = max(idle_tokens, busy_tokens)
        self._lock = threading.Lock()
        self._scheduled = False

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _slice(self, budget: int) -> bool:
        raise NotImplementedError

    def _take_all(self) -> list[Future]:
        raise NotImplementedError

    def _schedule(self) -> None:
        """(Under the lock.) One call on the engine, unless one is queued or nothing waits."""
        if self._scheduled or not self._has_work():
            return
        self._scheduled = True
        self.engine.call(self._run).add_done_callback(self._refused)

    def _refused(self, call: Future[None]) -> None:
        """The engine stopped (or never ran the call): every waiting request fails."""
        error = call.exception()
        if error is None:
            return
        with self._lock:
            waiting = self._take_all()
            self._scheduled = False
        for done in waiting:
            if not done.done():
                done.set_exception(error)

    def _run(self) -> None:
        """ENGINE THREAD: one slice; more while the engine has nothing else to do."""
        try:
            while True:
                idle = self.engine.running == 0 and self.engine.queued == 0
                if not self._slice(self.idle_tokens if idle else self.busy_tokens) or not idle:
                    break
        finally:
            with self._lock:
                self._scheduled = False
                self._schedule()
