"""The engine thread: loads the model, then serves queued requests one at a time.

MLX arrays and streams belong to the thread that made them, so this thread creates and touches
every MLX object; the event loop only enqueues requests and receives events.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from mlx_kvserve.engine.generate import Generator, Timings
from mlx_kvserve.engine.namespaces import make_states, use_namespace
from mlx_kvserve.engine.requests import Done, EngineError, GenerationRequest
from mlx_kvserve.engine.waitlist import WaitQueue

log = logging.getLogger("mlx_kvserve.engine")

_STOP = object()


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
        self.busy_seconds = 0.0  # time spent serving requests, for metrics
        self._observers: list[Callable[[GenerationRequest, Timings | None, float], None]] = []

    def add_observer(
        self, observer: Callable[[GenerationRequest, Timings | None, float], None]
    ) -> None:
        """Call `observer(request, timings or None, busy seconds)` on the engine thread after
        each request; it must be quick and must not raise (metrics)."""
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

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new work, fail queued requests, cancel the running one, join the thread."""
        self._stopping.set()
        self._cancel_all()
        with contextlib.suppress(queue.Full):  # drained just above
            self._queue.put_nowait(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.prompt_cache is not None and not self._thread.is_alive():
            self.prompt_cache.close()  # flush pending checkpoint writes, mark a clean exit

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
        except Exception as exc:  # a broken model must not kill the server silently
            self.load_error = f"model failed to load: {exc}"
            log.error("%s\n%s", self.load_error, traceback.format_exc())
            return
        self.ready.set()
        log.info("model ready (context %s tokens)", self.context_length)
        while True:
            item = self._queue.get()
            if item is _STOP or self._stopping.is_set():
                if isinstance(item, GenerationRequest):
                    item.emit(EngineError("the server is shutting down"))
                    continue
                return
            self._serve(item)

    def _serve(self, req: GenerationRequest) -> None:
        self._current = req
        started = time.perf_counter()
        timings: Timings | None = None
        try:
            if req.cancelled.is_set():
                req.emit(Done("cancelled", len(req.prompt_tokens), 0, 0))
                return
            assert self.generator is not None
            use_namespace(self.generator.states, req.namespace)
            timings = self.generator.run(req)
            log.info(timings.log_line(req))
        except Exception:
            log.error("request %s failed:\n%s", req.request_id, traceback.format_exc())
            req.emit(EngineError("internal error while generating; see the server log"))
        finally:
            self._current = None
            busy = time.perf_counter() - started
            self.busy_seconds += busy
            for observer in self._observers:
                try:
                    observer(req, timings, busy)
                except Exception:  # observing must never take the engine down
                    log.exception("metrics observer failed")


def _context_length(model: Any) -> int | None:
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "context_length", "max_seq_len"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


__all__ = ["Done", "Engine", "EngineBusy", "EngineNotReady"]
