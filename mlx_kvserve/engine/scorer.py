"""The prompt-scoring queue of one model's engine: prompts whose own tokens' log probabilities a
request asks for (engine/prompt_logprobs.py), run on the engine thread between generation's
steps.

Each piece of work is one `call()` on the engine (engine/calls.py), as embedding batches are
(embed/batcher.py): while the engine generates, a call feeds at most `busy_tokens` padded token
positions (about one prefill chunk's work), so a running generation waits for at most that;
while it has nothing else to do, one call goes on until the prompts run out or a generation
request arrives. Requests are served in the order they came; the prompts of one request are
batched together, shortest first, at most `batch_tokens` padded positions a batch. The prompts
of a request whose client has gone are dropped before they are computed.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from mlx_kvserve.engine.calls import BetweenSteps, EngineCalls
from mlx_kvserve.engine.prompt_logprobs import PromptLogprobs, PromptScoring

log = logging.getLogger("mlx_kvserve.engine")

BUSY_TOKENS = 512
IDLE_TOKENS = 2048  # positions a forward pass feeds: its logits are this many vocabulary rows
BATCH_TOKENS = 4096  # padded positions a batch holds (its KV, on top of the KV budget)
LOGITS_BYTES = 512 * 2**20  # the float32 logits a pass may hold: fewer positions for a wide
# vocabulary (152k ids: about 880 positions; 262k: 512)


class ScoreJob:
    """One request's prompts; `done` gets their figures in the prompts' order."""

    def __init__(self, rows: list[list[int]], top: int) -> None:
        self.rows = rows
        self.top = top
        self.results: list[PromptLogprobs | None] = [None] * len(rows)
        self.left = len(rows)
        self.done: Future[list[PromptLogprobs]] = Future()
        self.cancelled = threading.Event()
        self.dropped = False  # its prompts not computed are counted as dropped

    def cancel(self) -> None:
        """The client has gone: prompts not yet computed are dropped."""
        self.cancelled.set()

    @property
    def gone(self) -> bool:
        return self.cancelled.is_set() or self.done.done()


class Scorer(BetweenSteps):
    """The prompt-scoring queue of one model's engine."""

    def __init__(
        self,
        engine: EngineCalls,
        vocab: int | None,
        *,
        busy_tokens: int = BUSY_TOKENS,
        idle_tokens: int = IDLE_TOKENS,
        batch_tokens: int = BATCH_TOKENS,
        count: Callable[[str, int], None] = lambda outcome, n: None,
    ) -> None:
        """`vocab`: the ids the tokenizer writes (None: every logit is a token); `count(outcome,
        n)` hears of prompts "scored" and "dropped" (metrics)."""
        super().__init__(engine, busy_tokens, idle_tokens)
        self._count = count
        self.vocab = vocab
        self.batch_tokens = batch_tokens
        self.widest = max(1, LOGITS_BYTES // (4 * vocab)) if vocab else None  # positions a pass
        self._jobs: deque[ScoreJob] = deque()
        self._current: tuple[ScoreJob, list[int], PromptScoring] | None = None
        self.passes = 0  # forward passes run, for tests and the benchmark

    def submit(self, rows: list[list[int]], top: int) -> ScoreJob:
        """Queue a request's prompts (each at least one token id)."""
        job = ScoreJob(rows, top)
        if not rows:
            job.done.set_result([])
            return job
        with self._lock:
            self._jobs.append(job)
            self._schedule()
        return job

    def _has_work(self) -> bool:
        return bool(self._jobs) or self._current is not None

    def _take_all(self) -> list[Future]:
        waiting = list(self._jobs) + ([self._current[0]] if self._current else [])
        self._jobs, self._current = deque(), None
        return [job.done for job in waiting]

    def _slice(self, budget: int) -> bool:
        return self._advance(budget)

    def _advance(self, budget: int) -> bool:
        """One chunk of the current batch (starting the next if none); whether there was one."""
        current = self._current or self._next_batch()
        if current is None:
            return False
        job, indexes, scoring = current
        if job.gone:
            self._current = None
            self._drop(job)
            return True
        if self.widest is not None:
            budget = min(budget, self.widest)
        try:
            finished = scoring.step(budget)
        except Exception as exc:  # this request fails; the engine goes on
            log.exception("scoring %d prompts failed", len(indexes))
            self._current = None
            if not job.done.done():
                job.done.set_exception(exc)
            return True
        self.passes += 1
        self._current = None if finished else current
        if finished:
            self._count("scored", len(indexes))
            for index, result in zip(indexes, scoring.results(), strict=True):
                job.results[index] = result
                job.left -= 1
            if job.left == 0 and not job.done.done():
                job.done.set_result([r for r in job.results if r is not None])
        return True

    def _drop(self, job: ScoreJob) -> None:
        """Count the prompts of a departed client that were not computed (once)."""
        if not job.dropped and job.cancelled.is_set():
            job.dropped = True
            self._count("dropped", job.left)

    def _next_batch(self) -> tuple[ScoreJob, list[int], PromptScoring] | None:
        """The next prompts of the oldest request still waiting, shortest first, as many as fit
        `batch_tokens` padded positions (at least one)."""
        with self._lock:
            while self._jobs and self._jobs[0].gone:
                self._drop(self._jobs.popleft())
            if not self._jobs:
                return None
            job = self._jobs[0]
        waiting = sorted(
            (i for i, r in enumerate(job.results) if r is None), key=lambda i: len(job.rows[i])
        )
        taken: list[int] = []
        for i in waiting:
            if taken and len(job.rows[i]) * (len(taken) + 1) > self.batch_tokens:
                break
            taken.append(i)
        if len(taken) == len(waiting):
            with self._lock:
                self._jobs.popleft()
        model = self.engine.model
        assert model is not None, "the engine has no model"
        scoring = PromptScoring(model, [job.rows[i] for i in taken], job.top, self.vocab)
        self._current = (job, taken, scoring)
        return self._current
