"""The engine thread: loads the model, then serves queued requests in a continuous batch.

The loop admits a waiting request when there is room (a count, `max_concurrency`, and the
KV bytes it holds, its prompt and a growth reserve, within `kv_budget`: engine/ledger.py,
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

Each turn is one `Turn` of the engine's `Agreement` (engine/lockstep.py): alone, a turn decides
everything on the spot; in a job across machines, rank 0's turn decides and the other ranks'
turns replay its decisions. Every turn runs under one guard (engine/failures.py): a failure
fails the requests the turn touched and the engine goes on, or, when it cannot, it stops and
says why instead of dying silently.

Anything else that needs the cache or MLX (the /v1/cache figures) is a `call()`: run on this
thread between requests, or between two decode steps or prefill chunks of a running one.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_kvserve.cache.kinds import KVLayout
from mlx_kvserve.engine import faults
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.calls import CallQueue
from mlx_kvserve.engine.failures import Failures
from mlx_kvserve.engine.generate import Generator, PrefillTask, Timings
from mlx_kvserve.engine.image_prefill import VisionRows
from mlx_kvserve.engine.intake import EngineBusy, EngineNotReady, Intake, RequestTooLarge
from mlx_kvserve.engine.ledger import RESERVE_TOKENS
from mlx_kvserve.engine.loading import Loader, Loading, MakeAgreement, log_ready
from mlx_kvserve.engine.lockstep import Agreement, Draws, Lockstep, Solo, Turn
from mlx_kvserve.engine.memory import MemoryPolicy
from mlx_kvserve.engine.namespaces import Caches
from mlx_kvserve.engine.requests import STOP, Done, GenerationRequest, Item
from mlx_kvserve.engine.room import Room
from mlx_kvserve.engine.schedule import Scheduler
from mlx_kvserve.engine.sequence import Sequence
from mlx_kvserve.engine.speculation.continuations import Continuations
from mlx_kvserve.engine.speculation.draft_model import DraftLoader
from mlx_kvserve.engine.stopping import Stopping
from mlx_kvserve.engine.waitlist import WaitQueue
from mlx_kvserve.json_value import JSON

log = logging.getLogger("mlx_kvserve.engine")

DEFAULT_MLX_CACHE_LIMIT = 512 << 20

T = TypeVar("T")


class Engine(Intake, Stopping, Failures, Loading):
    def __init__(
        self,
        loader: Loader,
        *,
        prompt_cache: Caches = None,
        cache_enabled: bool = True,
        prefill_step: int = 512,
        checkpoint_interval: int = 2048,
        max_queue: int = 16,
        mlx_cache_limit: int = DEFAULT_MLX_CACHE_LIMIT,
        max_concurrency: int = 8,
        kv_budget: int | None = None,
        live_budget: int = 1 << 30,
        kv_reserve: int = RESERVE_TOKENS,
        speculation: str = "off",
        draft_loader: DraftLoader | None = None,
        context_length: int | None = None,
        job: MakeAgreement | None = None,
    ) -> None:
        """`loader` runs on the engine thread and returns (model, tokenizer) as mlx_lm.load does
        (or a `Loaded`, which may replace the prompt cache).

        `prompt_cache` (a PromptCache, one per API key, or None) is used from the engine thread
        only and closed (pending writes flushed) when the engine stops; `cache_enabled=False`
        also disables reuse of the previous request's live KV state, for cache-off comparisons.
        `kv_budget` None means half the memory left beside the model (engine/memory.py).
        `speculation` "auto" lets the decode batch draft and verify (engine/speculation/; in
        a job across machines every rank alike: engine/speculation/job.py); `draft_loader`
        (run on the engine thread after the model's loader) gives it a draft model of the same
        tokenizer. `context_length` is the window the model's config states
        (models/context.py); None falls back to the model object's args. `job` makes the
        agreement of the job this engine steps with across machines (engine/lockstep.py); None:
        this process alone (`Solo`).
        """
        self._loader = loader
        self.prompt_cache = prompt_cache
        self.cache_enabled = cache_enabled
        self.prefill_step = prefill_step
        self.checkpoint_interval = checkpoint_interval
        self.generator: Generator | None = None
        self._queue = WaitQueue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self.max_concurrency = max(1, max_concurrency)
        self.kv_budget = kv_budget
        self.live_budget = live_budget
        self.kv_reserve = kv_reserve
        self.speculation = speculation
        self._draft_loader = draft_loader
        self.room: Room | None = None  # the KV ledger, once the model is loaded
        self.layout: KVLayout | None = None
        self.batch: DecodeBatch | None = None
        self.schedule = Scheduler(prefill_step)  # the prefills in flight
        self._held: GenerationRequest | None = None  # next in line, waiting for room
        self._inflight: dict[str, GenerationRequest] = {}  # taken from the queue, not ended
        self._touched: list[GenerationRequest] = []  # by the current turn (engine/failures.py)
        self._can_batch = False
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._intake = threading.Lock()  # a request is queued, or the engine has failed
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.model: nn.Module | None = None
        self.tokenizer: TokenizerWrapper | None = None
        self.vision: VisionRows | None = None  # a vision model's tower, once loaded
        self.context_length: int | None = context_length
        self.memory = MemoryPolicy(mlx_cache_limit, prefill_step)
        self._calls = CallQueue()
        self.busy_seconds = 0.0  # time spent serving requests, for metrics
        self._observers: list[Callable[[GenerationRequest, Timings | None], None]] = []
        self._job = job
        self.lockstep: Agreement = Solo()  # the job's once the model is loaded (`job`)
        self._draws = Draws()  # each row's tokens, for the turn's digest across ranks
        self.continuations: Continuations | None = None  # finished requests' tokens (`_ended`)

    generates = True  # (embed/encoder.py's engine embeds only)

    @property
    def unloadable(self) -> bool:
        """False in a job across machines: every rank stops with it (cli/serve_job.py)."""
        return self._job is None

    @property
    def cluster(self) -> dict[str, JSON] | None:
        """The job's ranks, for /health (None: this process alone)."""
        return self.lockstep.cluster

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
    def running(self) -> int:
        """Requests prefilling or decoding."""
        return len(self.schedule) + (len(self.batch) if self.batch is not None else 0)

    @property
    def paused(self) -> int:
        """Requests paused mid-decode for memory, waiting to resume."""
        return len(self.room.paused) if self.room is not None else 0

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread (between requests, decode steps or prefill chunks)."""
        down = self._stopping.is_set() or not self.ready.is_set() or not self._thread.is_alive()
        problem = self.load_error or self.failure or "the engine is not running"
        future = self._calls.put(fn, EngineNotReady(problem) if down else None)
        if not down:
            self._queue.wake()  # an idle engine runs it now, not after its IDLE_POLL wait
        return future

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # a broken model must not kill the server silently
            self.load_error = f"model failed to load: {exc}"
            log.error("%s\n%s", self.load_error, traceback.format_exc())
            return
        assert self.kv_budget is not None and self.layout is not None
        self.ready.set()
        log_ready(
            self.context_length, self.layout, self.max_concurrency, self._can_batch, self.kv_budget
        )
        try:
            self._loop()
        except BaseException as exc:  # not an Exception of a turn (those are guarded)
            self._die(f"the engine thread ended: {exc!r}")
            raise
        finally:
            self._calls.fail_all(EngineNotReady(self.failure or "the engine stopped"))
            self.memory.stop()

    def _loop(self) -> None:
        """Turn after turn, each under the guard (engine/failures.py), until the engine stops."""
        while True:
            self._calls.run()
            self._touched = []
            try:
                with self._start_turn() as turn:
                    item = self._turn(turn)
            except Exception as error:
                if self._recover(error):
                    continue
                return
            self._blameless = 0
            if item is STOP:
                self._shut_down()
                return

    def _turn(self, turn: Turn) -> Item:
        """One turn: take the next request if it has room, resume a paused one if it fits,
        then run one piece of work: a prefill chunk, or a decode step of the batch."""
        assert self.batch is not None
        faults.maybe_fail("turn")
        item = turn.next_item(self._take)
        if item is STOP:
            return item
        started = time.perf_counter()
        if isinstance(item, GenerationRequest):
            self._begin(item)
        self._resume(turn)
        task = self._choose(turn)
        if task is not None:
            self._advance(task, turn)
        elif self.batch:
            self._step(turn)
        elif item is None:
            return None  # idle
        self.busy_seconds += time.perf_counter() - started
        return item

    def _start_turn(self) -> Turn:
        """A turn of the loop begins: across machines, where every rank checks it is in step."""
        return self.lockstep.turn(self._active(), self._digest())

    def _digest(self) -> list[JSON]:
        """What this engine's batch looks like, for the ranks of a job to compare."""
        assert self.batch is not None and self.room is not None
        digest: list[JSON] = [len(self.batch), len(self.schedule), len(self.room.paused)]
        if self.lockstep.distributed:  # the drafts each row kept, then the tokens it drew
            digest.append(self.batch.speculated())
            digest.append(self._draws.of(self.batch.requests))
        return digest

    def _choose(self, turn: Turn) -> PrefillTask | None:
        """The prefill chunk to run next, or None for a decode step (engine/schedule.py)."""
        tasks = self.schedule.tasks

        def choose() -> int:
            task = self.schedule.choose(decoding=bool(self.batch))
            return -1 if task is None else tasks.index(task)

        index = turn.decide(choose)
        return None if index < 0 else tasks[index]

    def _busy(self) -> bool:
        assert self.batch is not None
        return bool(self.batch) or bool(self.schedule)

    def _resume(self, turn: Turn) -> None:
        """A paused request rejoins (a prefill from its checkpoint) when it fits again."""
        assert self.room is not None and self.generator is not None
        self._end_paused()
        oldest = self.room.next_paused()
        if oldest is None or (self._busy() and not self._can_join()):
            return
        self._touched.append(oldest.req)
        faults.maybe_fail("resume")
        task = self.room.next_resume(  # the generator's model: MTP heads' tap, if any
            self.generator.model, self.prefill_step, self._busy(), turn.decide, self.vision
        )
        if task is not None:
            self.schedule.add(task)

    def _end_paused(self) -> None:
        """Paused requests whose client went away end now (their KV was stored at the pause)."""
        assert self.room is not None
        for seq in self.room.cancel_paused():
            self._touched.append(seq.req)
            seq.cancel()
            seq.live.tokens = []  # no caches: nothing to store or keep resident
            self._ended(seq)

    def _begin(self, req: GenerationRequest) -> None:
        """Start `req`'s prefill; the scheduler runs it chunk by chunk beside the batch."""
        assert self.generator is not None and self.room is not None
        self._touched.append(req)
        self._inflight[req.request_id] = req
        if not self.lockstep.leader:
            self.room.take(req)  # rank 0 admitted it
        if req.cancelled.is_set():
            self._end_unstarted(req)
        else:
            self.schedule.add(self.generator.begin(req))

    def _advance(self, task: PrefillTask, turn: Turn) -> None:
        """One chunk of `task`'s prefill; when it is done the request joins the batch."""
        assert self.batch is not None
        self._touched.append(task.req)
        before = task.remaining if task.started else 0
        try:
            with turn.working("a prefill chunk", min(task.remaining, self.prefill_step)):
                started = time.perf_counter()
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
            self._touched += self.batch.requests  # a join merges its caches into theirs
            self.batch.add(seq)
            for fork in seq.forks:  # the other choices of an `n` request: rows of their own
                self._inflight[fork.req.request_id] = fork.req
                self._touched.append(fork.req)
                self.room.take(fork.req)
                self.batch.add(fork)
            seq.forks = []

    def _release(self, req: GenerationRequest) -> None:
        """`req` holds no KV any more (ended, failed, cancelled in its prefill)."""
        if self.room is not None:
            self.room.release(req)

    def _step(self, turn: Turn) -> None:
        assert self.batch is not None and self.room is not None
        self._touched += self.batch.requests
        faults.maybe_fail("before_step")
        # may pause the youngest, or end one alone and full
        self.room.before_step(self.batch, turn.decide)
        if not self.batch:
            return
        self.batch.agree(turn.decide)  # in a job, rank 0's timings weigh every rank's drafts
        try:
            with turn.working("a decode step", len(self.batch)):
                started = time.perf_counter()
                faults.maybe_fail("decode")
                faults.maybe_fail("decode_stall")  # a rank stuck inside a step (tests)
                self.batch.step()
            self.schedule.decoded(time.perf_counter() - started)
        except Exception:
            self._failed([seq.req for seq in self.batch.fail_all()])

    def _ended(self, seq: Sequence) -> None:
        """A sequence left the batch: Done to its client, its log line, its checkpoint."""
        assert self.generator is not None
        log.info(seq.timings.log_line(seq.req))
        self._release(seq.req)
        held = seq.live.key()  # its images keyed by content: the index leaves them out
        tokens = None if held is None else held + seq.feed
        try:
            self.generator.finish(seq)
        except Exception:  # after its Done: only the checkpoint is lost
            log.exception("request %s: saving its KV failed", seq.req.request_id)
        if self.continuations is not None and tokens is not None:  # a draft source from now on
            self.continuations.remember(seq.req.namespace, tokens, seq.timings.cached_tokens)

    def _same_pass(self, shape: list[int]) -> None:
        """In a job that speculates: this decode pass is of rank 0's shape (lockstep.py)."""
        assert isinstance(self.lockstep, Lockstep) and self.batch is not None
        self.lockstep.same_pass(shape, self.batch.requests)

    def _observe(self, req: GenerationRequest, timings: Timings | None) -> None:
        """`req` has ended (its final event follows): it leaves the engine; observers see it."""
        self._inflight.pop(req.request_id, None)
        for observer in self._observers:
            try:
                observer(req, timings)
            except Exception:  # observing must never take the engine down
                log.exception("metrics observer failed")


__all__ = ["Done", "Engine", "EngineBusy", "EngineNotReady", "RequestTooLarge"]
