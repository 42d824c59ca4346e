"""The engine thread: loads the model, then serves queued requests in a continuous batch.

The loop admits a waiting request when there is room (a count, `max_concurrency`, and the
KV bytes it holds, its prompt and a growth reserve, within `kv_budget`: engine/admission.py,
engine/room.py, which also pause the youngest request when memory runs out mid-decode and
resume it later) and starts its prefill through the prompt cache. Each turn of the loop then
runs one piece of work, chosen by engine/schedule.py: a chunk of one request's prefill, or one
decode step of the batch (engine/batch.py), which a request joins once its prefill is done. A
request that waits for room stays at the head of the queue.

MLX arrays and streams belong to the thread that made them, so this thread creates and touches
every MLX object; the event loop only enqueues requests and receives events. Since MLX 0.32 the
default stream is per thread (`mlx/stream.h`: "the default stream of current thread"), so this
thread's default stream already is a stream of its own for generation, which is what
mlx_lm.server's generation thread uses too (`mlx_lm/server.py`, `_generate`).

Anything else that needs the cache or MLX (the /v1/cache figures) is a `call()`: run on this
thread between requests, or between two decode steps or prefill chunks of a running one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from mlx_kvserve.cache.kinds import KVLayout
from mlx_kvserve.engine.admission import RESERVE_TOKENS
from mlx_kvserve.engine.batch import DecodeBatch, can_batch
from mlx_kvserve.engine.calls import CallQueue
from mlx_kvserve.engine.generate import Generator, PrefillTask, Timings
from mlx_kvserve.engine.loading import describe_loaded, log_ready
from mlx_kvserve.engine.lockstep import Agreement, Solo
from mlx_kvserve.engine.memory import MemoryPolicy
from mlx_kvserve.engine.namespaces import make_states
from mlx_kvserve.engine.requests import CancelLatch, Done, EngineError, GenerationRequest
from mlx_kvserve.engine.room import Room
from mlx_kvserve.engine.schedule import Scheduler
from mlx_kvserve.engine.sequence import Sequence
from mlx_kvserve.engine.stopping import STOP, Stopping
from mlx_kvserve.engine.waitlist import WaitQueue

log = logging.getLogger("mlx_kvserve.engine")

IDLE_POLL = 0.05  # seconds: how soon an idle engine runs a call()

DEFAULT_MLX_CACHE_LIMIT = 512 << 20


class EngineNotReady(Exception):
    """The model is still loading (or failed to load)."""


class EngineBusy(Exception):
    """The request queue is full."""


class RequestTooLarge(Exception):
    """The request's prompt could never fit in the KV budget, even alone; the message says why."""


class Engine(Stopping):
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
        max_concurrency: int = 8,
        kv_budget: int | None = None,
        live_budget: int = 1 << 30,
        kv_reserve: int = RESERVE_TOKENS,
        context_length: int | None = None,
        lockstep: Agreement | None = None,
    ) -> None:
        """`loader` runs on the engine thread and returns (model, tokenizer) as mlx_lm.load does.

        `prompt_cache` (a PromptCache or None) is used from the engine thread only and closed
        (pending writes flushed) when the engine stops; `cache_enabled=False` also disables
        reuse of the previous request's live KV state, for cache-off comparisons.
        `kv_budget` None means half the memory left beside the model (engine/memory.py).
        `context_length` is the window the model's config states (models/context.py); None
        falls back to the model object's args. `lockstep` is the job this engine steps with
        across machines (engine/lockstep.py); None: this process alone.
        """
        self._loader = loader
        self.prompt_cache = prompt_cache
        self.cache_enabled = cache_enabled
        self.prefill_step = prefill_step
        self.checkpoint_interval = checkpoint_interval
        self.generator: Generator | None = None
        self._queue: queue.Queue[Any] = WaitQueue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self.max_concurrency = max(1, max_concurrency)
        self.kv_budget = kv_budget
        self.live_budget = live_budget
        self.kv_reserve = kv_reserve
        self.room: Room | None = None  # the KV ledger, once the model is loaded
        self.layout: KVLayout | None = None
        self.batch: DecodeBatch | None = None
        self.schedule = Scheduler(prefill_step)  # the prefills in flight
        self._held: GenerationRequest | None = None  # next in line, waiting for room
        self._can_batch = False
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.context_length: int | None = context_length
        self.memory = MemoryPolicy(mlx_cache_limit, prefill_step)
        self._calls = CallQueue()
        self.busy_seconds = 0.0  # time spent serving requests, for metrics
        self._observers: list[Callable[[GenerationRequest, Timings | None], None]] = []
        self.lockstep: Agreement = lockstep or Solo()
        self.cluster: dict[str, Any] | None = None  # the job's ranks, for /health
        self.unloadable = True  # False in a job across machines: every rank stops with it

    def add_observer(self, observer: Callable[[GenerationRequest, Timings | None], None]) -> None:
        """Call `observer(request, timings or None if it failed)` on the engine thread once per
        request, before the client gets its final event; it must be quick (metrics)."""
        self._observers.append(observer)

    def start(self) -> None:
        """Start the engine thread (once: a job's rank 0 starts it before its pool does)."""
        if self._thread.ident is None:
            self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end (a job's other ranks: until rank 0 stops them)."""
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self._queue.qsize() + isinstance(self._held, GenerationRequest)

    @property
    def running(self) -> int:
        """Requests prefilling or decoding."""
        return len(self.schedule) + (len(self.batch) if self.batch is not None else 0)

    @property
    def paused(self) -> int:
        """Requests paused mid-decode for memory, waiting to resume."""
        return len(self.room.paused) if self.room is not None else 0

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request for the engine thread; raises instead of waiting when it cannot."""
        if self._draining.is_set() or self._stopping.is_set():
            raise EngineNotReady("the server is shutting down")
        if not self.ready.is_set():
            raise EngineNotReady(self.load_error or "the model is still loading")
        if self.room is not None and not self.room.fits_alone(req):
            raise RequestTooLarge(self.room.too_large(req))
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

    def _active(self) -> list[GenerationRequest]:
        """Requests the engine has taken: held for room, prefilling, decoding (any thread)."""
        batch = self.batch
        active = list(batch.requests) if batch is not None else []
        active += [task.req for task in self.schedule]
        active += [seq.req for seq, _ in (self.room.paused if self.room is not None else ())]
        return active + ([self._held] if isinstance(self._held, GenerationRequest) else [])

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread (between requests, decode steps or prefill chunks)."""
        down = self._stopping.is_set() or not self.ready.is_set() or not self._thread.is_alive()
        refuse = EngineNotReady(self.load_error or "the engine is not running") if down else None
        return self._calls.put(fn, refuse)

    def _run(self) -> None:
        try:
            self.model, self.tokenizer = self._loader()
            self.context_length, self.layout = describe_loaded(self.model, self.context_length)
            # A model whose caches cannot take a state back keeps its resident sessions but
            # stores no checkpoint (see `describe_loaded`).
            checkpoints_to = None if self.layout.unrestorable else self.prompt_cache
            states = make_states(
                self.model,
                checkpoints_to,
                enabled=self.cache_enabled,
                live_budget=self.live_budget,
                job=self.lockstep if self.lockstep.distributed else None,
            )
            if self.lockstep.distributed:
                self.lockstep.attach_cache(checkpoints_to)
            self.generator = Generator(
                self.model,
                self.tokenizer,
                states,
                prefill_step=self.prefill_step,
                checkpoint_interval=self.checkpoint_interval,
            )
            self.generator.after_prefill = self.memory.after_prefill
            self.generator.before_done = self._observe
            self.memory.start(self.model)
            # Across machines a rank holds some layers only (a pipeline): what its caches can
            # do is agreed, so that every rank batches and chunks alike.
            self._can_batch = self.lockstep.all_true(can_batch(self.layout), "batching")
            self.generator.sliceable = self.lockstep.all_true(self.layout.sliceable, "slicing")
            if self.kv_budget is None:
                self.kv_budget = self.memory.default_kv_budget(self.model)
            self.room = Room(
                self.layout.layers,
                self.kv_budget,
                states,
                checkpoints_to,
                self.kv_reserve,
                batched=self._can_batch,
            )
            self.batch = DecodeBatch(self.model, self._ended, mergeable=self._can_batch)
        except Exception as exc:  # a broken model must not kill the server silently
            self.load_error = f"model failed to load: {exc}"
            log.error("%s\n%s", self.load_error, traceback.format_exc())
            return
        self.ready.set()
        log_ready(
            self.context_length, self.layout, self.max_concurrency, self._can_batch, self.kv_budget
        )
        try:
            self._loop()
        finally:
            self._calls.fail_all(EngineNotReady("the engine stopped"))
            self.memory.stop()

    def _loop(self) -> None:
        assert self.batch is not None and self.room is not None
        while True:
            self._calls.run()
            self._start_turn()
            item = self.lockstep.next_item(self._take)
            if item is STOP:
                self.lockstep.flush()
                self._shut_down()
                return
            started = time.perf_counter()
            if isinstance(item, GenerationRequest):
                if not self.lockstep.leader:
                    self.room.take(item)  # rank 0 admitted it
                self._begin(item)
            self._resume()
            task = self._choose()
            if task is not None:
                self._advance(task)
            elif self.batch:
                self._step()
            elif not isinstance(item, GenerationRequest):
                self.lockstep.flush()
                continue
            self.lockstep.flush()
            self.busy_seconds += time.perf_counter() - started

    def _start_turn(self) -> None:
        """A turn of the loop begins: across machines, where every rank checks it is in step."""
        assert self.batch is not None and self.room is not None
        digest = [len(self.batch), len(self.schedule), len(self.room.paused)]
        digest.append(sum(len(req.sampled) for req in self.batch.requests))
        self.lockstep.tick(self._active(), digest)

    def _take(self) -> Any:
        """Rank 0's (or a lone engine's) next item: STOP, a request that has room, or None."""
        return STOP if self._stopping.is_set() else self._next()

    def _choose(self) -> PrefillTask | None:
        """The prefill chunk to run next, or None for a decode step (engine/schedule.py)."""
        tasks = self.schedule.tasks

        def choose() -> int:
            task = self.schedule.choose(decoding=bool(self.batch))
            return -1 if task is None else tasks.index(task)

        index = self.lockstep.decide(choose)
        return None if index < 0 else tasks[index]

    def _busy(self) -> bool:
        assert self.batch is not None
        return bool(self.batch) or bool(self.schedule)

    def _resume(self) -> None:
        """A paused request rejoins (a prefill from its checkpoint) when it fits again."""
        assert self.room is not None and self.generator is not None
        self._end_paused()
        if not self.room.paused or (self._busy() and not self._can_join()):
            return
        task = self.room.next_resume(
            self.model, self.prefill_step, self._busy(), self.lockstep.decide
        )
        if task is not None:
            self.schedule.add(task)

    def _next(self) -> Any:
        """The next request if there is room for it, STOP, or None (run work / idle)."""
        if self._held is None:
            if self._busy() and not self._can_join():
                return None  # full by count: leave the queue as it is
            try:
                if self._busy():
                    self._held = self._queue.get_nowait()
                else:
                    self._held = self._queue.get(timeout=IDLE_POLL)
            except queue.Empty:
                return None
        item = self._held
        if not isinstance(item, GenerationRequest) or self._has_room(item):
            self._held = None
            return item
        if item.cancelled.is_set():  # gave up while waiting for room
            self._held = None
            self._end_unstarted(item)
        return None

    def _can_join(self) -> bool:
        """Room by count. A model that decodes one at a time takes requests all the same: their
        lookups, restores and prefills run beside the one decoding (the batch holds them)."""
        return self.running < self.max_concurrency

    def _end_paused(self) -> None:
        """Paused requests whose client went away end now (their KV was stored at the pause)."""
        assert self.room is not None
        for seq in self.room.cancel_paused():
            seq.cancel()
            seq.live.tokens = []  # no caches: nothing to store or keep resident
            self._ended(seq)

    def _has_room(self, req: GenerationRequest) -> bool:
        assert self.room is not None
        if self._busy() and not self._can_join():
            return False
        return self.room.admit(req, self._busy())

    def _end_unstarted(self, req: GenerationRequest) -> None:
        """End a request that never reached the generator (cancelled while queued)."""
        self._observe(req, None)
        req.emit(Done("cancelled", len(req.prompt_tokens), 0, 0))

    def _begin(self, req: GenerationRequest) -> None:
        """Start `req`'s prefill; the scheduler runs it chunk by chunk beside the batch."""
        assert self.generator is not None
        if req.cancelled.is_set():
            self._end_unstarted(req)
        else:
            self.schedule.add(self.generator.begin(req))

    def _advance(self, task: PrefillTask) -> None:
        """One chunk of `task`'s prefill; when it is done the request joins the batch."""
        assert self.batch is not None
        before = task.remaining if task.started else 0
        self.lockstep.flush()
        started = time.perf_counter()
        try:
            with self.lockstep.working("a prefill chunk"):
                finished = task.advance()
        except Exception:
            self.schedule.remove(task)
            self._failed([task.req])
            return
        self.schedule.prefilled(task, before - task.remaining, time.perf_counter() - started)
        if not finished:
            return
        self.schedule.remove(task)
        assert task.result is not None
        timings, seq = task.result
        if seq is None:  # cancelled during its prefill
            log.info(timings.log_line(task.req))
            self._release(task.req)
        else:
            self.batch.add(seq)

    def _release(self, req: GenerationRequest) -> None:
        """`req` holds no KV any more (ended, failed, cancelled in its prefill)."""
        assert self.room is not None
        self.room.release(req)

    def _step(self) -> None:
        assert self.batch is not None and self.room is not None
        # may pause the youngest, or end one alone and full
        self.room.before_step(self.batch, self.lockstep.decide)
        self.lockstep.flush()
        if not self.batch:
            return
        started = time.perf_counter()
        try:
            with self.lockstep.working("a decode step"):
                self.batch.step()
            self.schedule.decoded(time.perf_counter() - started)
        except Exception:
            self._failed([seq.req for seq in self.batch.fail_all()])

    def _ended(self, seq: Sequence) -> None:
        """A sequence left the batch: Done to its client, its log line, its checkpoint."""
        assert self.generator is not None
        log.info(seq.timings.log_line(seq.req))
        self._release(seq.req)
        try:
            self.generator.finish(seq)
        except Exception:  # after its Done: only the checkpoint is lost
            log.exception("request %s: saving its KV failed", seq.req.request_id)

    def _failed(self, reqs: list[GenerationRequest]) -> None:
        log.error(
            "request %s failed:\n%s",
            ", ".join(r.request_id for r in reqs),
            traceback.format_exc(),
        )
        for req in reqs:
            if self.room is not None:
                self._release(req)
            self._observe(req, None)
            req.emit(EngineError("internal error while generating; see the server log"))

    def _observe(self, req: GenerationRequest, timings: Timings | None) -> None:
        for observer in self._observers:
            try:
                observer(req, timings)
            except Exception:  # observing must never take the engine down
                log.exception("metrics observer failed")


__all__ = ["Done", "Engine", "EngineBusy", "EngineNotReady", "RequestTooLarge"]
