"""The engine thread: loads the model, then serves queued requests one at a time.

MLX arrays and streams belong to the thread that made them, so this thread creates and touches
every MLX object; the event loop only enqueues requests and receives events. Since MLX 0.32 the
default stream is per thread (`mlx/stream.h`: "the default stream of current thread"), so this
thread's default stream already is a stream of its own for generation, which is what
mlx_lm.server's generation thread uses too (`mlx_lm/server.py`, `_generate`).

Anything else that needs the cache or MLX (the /v1/cache figures) is a `call()`: run on this
thread between requests, or between two decode steps or prefill chunks of a running one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from mlx_kvserve.engine.generate import Generator, Timings
from mlx_kvserve.engine.memory import MemoryPolicy
from mlx_kvserve.engine.namespaces import make_states, use_namespace
from mlx_kvserve.engine.requests import Done, EngineError, GenerationRequest
from mlx_kvserve.engine.waitlist import WaitQueue

log = logging.getLogger("mlx_kvserve.engine")

_STOP = object()
IDLE_POLL = 0.05  # seconds: how soon an idle engine runs a call()

DEFAULT_MLX_CACHE_LIMIT = 512 << 20


class EngineNotReady(Exception):
    """The model is still loading (or failed to load)."""


class EngineBusy(Exception):
    """The request queue is full."""


class Engine:
    def __init__(
        self,
        loader: Callable[[], tuple[Any, Any]],
        *,
        prompt_cache: Any = None,
        cache_enabled: bool = True,
        prefill_step: int = 512,
        checkpoint_interval: int = 2048,
        max_queue: int = 16,
        mlx_cache_limit: int = DEFAULT_MLX_CACHE_LIMIT,
    ) -> None:
        """`loader` runs on the engine thread and returns (model, tokenizer) as mlx_lm.load does.

        `prompt_cache` (a PromptCache or None) is used from the engine thread only and closed
        (pending writes flushed) when the engine stops; `cache_enabled=False` also disables
        reuse of the previous request's live KV state, for cache-off comparisons.
        """
        self._loader = loader
        self.prompt_cache = prompt_cache
        self.cache_enabled = cache_enabled
        self.prefill_step = prefill_step
        self.checkpoint_interval = checkpoint_interval
        self.generator: Generator | None = None
        self._queue: queue.Queue[Any] = WaitQueue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._current: GenerationRequest | None = None
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.context_length: int | None = None
        self.memory = MemoryPolicy(mlx_cache_limit, prefill_step)
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self.busy_seconds = 0.0  # time spent serving requests, for metrics
        self._observers: list[Callable[[GenerationRequest, Timings | None], None]] = []
        self._observed = False  # the current request has been shown to the observers

    def add_observer(self, observer: Callable[[GenerationRequest, Timings | None], None]) -> None:
        """Call `observer(request, timings or None if it failed)` on the engine thread once per
        request, before the client gets its final event; it must be quick (metrics)."""
        self._observers.append(observer)

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request for the engine thread; raises instead of waiting when it cannot."""
        if self._draining.is_set() or self._stopping.is_set():
            raise EngineNotReady("the server is shutting down")
        if not self.ready.is_set():
            raise EngineNotReady(self.load_error or "the model is still loading")
        try:
            self._queue.put_nowait(req)
        except queue.Full:
            raise EngineBusy from None

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
        current = self._current
        if current is not None:
            current.cancel()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread (between requests, decode steps or prefill chunks)."""
        future: Future = Future()
        if self._stopping.is_set() or not self.ready.is_set() or not self._thread.is_alive():
            future.set_exception(EngineNotReady(self.load_error or "the engine is not running"))
        else:
            self._calls.append((fn, future))
        return future

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
            self._queue.put_nowait(_STOP)

    def _close_cache(self) -> None:
        if self.prompt_cache is not None and not self._thread.is_alive():
            self.prompt_cache.close()  # flush pending checkpoint writes, mark a clean exit

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller gets it; the engine carries on
                future.set_exception(exc)

    def _run(self) -> None:
        try:
            self.model, self.tokenizer = self._loader()
            self.context_length = _context_length(self.model)
            states = make_states(self.model, self.prompt_cache, enabled=self.cache_enabled)
            self.generator = Generator(
                self.model,
                self.tokenizer,
                states,
                prefill_step=self.prefill_step,
                checkpoint_interval=self.checkpoint_interval,
            )
            self.generator.between_steps = self._run_calls
            self.generator.after_prefill = self.memory.after_prefill
            self.generator.before_done = self._observe
            self.memory.start(self.model)
        except Exception as exc:  # a broken model must not kill the server silently
            self.load_error = f"model failed to load: {exc}"
            log.error("%s\n%s", self.load_error, traceback.format_exc())
            return
        self.ready.set()
        log.info("model ready (context %s tokens)", self.context_length)
        try:
            self._loop()
        finally:
            self._fail_calls()
            self.memory.stop()

    def _loop(self) -> None:
        while True:
            self._run_calls()
            try:
                item = self._queue.get(timeout=IDLE_POLL)
            except queue.Empty:
                continue
            if item is _STOP or self._stopping.is_set():
                if isinstance(item, GenerationRequest):
                    item.emit(EngineError("the server is shutting down"))
                    continue
                return
            self._serve(item)

    def _fail_calls(self) -> None:
        while self._calls:
            _, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineNotReady("the engine stopped"))

    def _observe(self, req: GenerationRequest, timings: Timings | None) -> None:
        self._observed = True
        for observer in self._observers:
            try:
                observer(req, timings)
            except Exception:  # observing must never take the engine down
                log.exception("metrics observer failed")

    def _serve(self, req: GenerationRequest) -> None:
        self._current = req
        self._observed = False
        started = time.perf_counter()
        timings: Timings | None = None
        try:
            if req.cancelled.is_set():
                self._observe(req, None)
                req.emit(Done("cancelled", len(req.prompt_tokens), 0, 0))
                return
            assert self.generator is not None
            use_namespace(self.generator.states, req.namespace)
            timings = self.generator.run(req)
            log.info(timings.log_line(req))
        except Exception:
            log.error("request %s failed:\n%s", req.request_id, traceback.format_exc())
            if not self._observed:
                self._observe(req, None)
            req.emit(EngineError("internal error while generating; see the server log"))
        finally:
            self._current = None
            self.busy_seconds += time.perf_counter() - started


def _context_length(model: Any) -> int | None:
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "context_length", "max_seq_len"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


__all__ = ["Done", "Engine", "EngineBusy", "EngineNotReady"]
