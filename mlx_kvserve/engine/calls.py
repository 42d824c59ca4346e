"""Work other threads hand to the engine thread: MLX objects belong to the thread that made them.

The /v1/cache figures, tests' probes and anything else that touches the prompt cache or MLX run
as a call on the engine thread, between two pieces of its work (a decode step, a prefill chunk)
or at once when it is idle (`Engine.call` wakes its wait for requests). The caller gets a
`Future`.
"""

from __future__ import annotations

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
