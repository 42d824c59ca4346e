"""Embedding inputs of every request on one model, packed into padded batches under a token
budget and run on the model's engine thread between generation's steps.

Each batch is one `call()` on the engine (engine/calls.py): it runs between two decode steps or
prefill chunks, so a running generation waits for at most one batch, and a batch queued by a
batch runs at the next boundary. While the engine generates, a batch holds at most
`busy_tokens` padded token positions (about one prefill chunk's work); while it has nothing
else to do, one call runs batches of up to `idle_tokens` back to back until the inputs run out
or a generation request arrives. Inputs of one request are queued shortest first, so rows of
like length share a batch; requests are served in the order they came. The inputs of a request
whose client has gone are dropped before they are computed.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from mlx_kvserve.embed.encoder import encode_rows
from mlx_kvserve.embed.pooling import ENCODER, embed_rows
from mlx_kvserve.engine.calls import BetweenSteps, EngineCalls

log = logging.getLogger("mlx_kvserve.embed")

BUSY_TOKENS = 512
IDLE_TOKENS = 4096  # vllm-mlx's sub-batch of padded positions


class EmbedJob:
    """One request's inputs; `done` gets their vectors in the inputs' order."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows
        self.vectors: list[np.ndarray | None] = [None] * len(rows)
        self.left = len(rows)
        self.done: Future[list[np.ndarray]] = Future()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        """The client has gone: inputs not yet computed are dropped."""
        self.cancelled.set()


@dataclass(frozen=True)
class _Input:
    job: EmbedJob
    index: int

    @property
    def tokens(self) -> list[int]:
        return self.job.rows[self.index]


class Embedder(BetweenSteps):
    """The embedding queue of one model's engine."""

    def __init__(
        self,
        engine: EngineCalls,
        pooling: str,
        *,
        busy_tokens: int = BUSY_TOKENS,
        idle_tokens: int = IDLE_TOKENS,
        count: Callable[[str, int], None] = lambda outcome, n: None,
    ) -> None:
        """`count(outcome, n)` hears of inputs "embedded" and "dropped" (metrics)."""
        super().__init__(engine, busy_tokens, idle_tokens)
        self.pooling = pooling
        self._count = count
        self._pending: deque[_Input] = deque()
        self.batches = 0  # forward passes run, for tests and the benchmark

    def submit(self, rows: list[list[int]]) -> EmbedJob:
        """Queue a request's inputs (each at least one token id)."""
        job = EmbedJob(rows)
        if not rows:
            job.done.set_result([])
            return job
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        with self._lock:
            self._pending.extend(_Input(job, i) for i in order)
            self._schedule()
        return job

    def _has_work(self) -> bool:
        return bool(self._pending)

    def _take_all(self) -> list[Future]:
        waiting, self._pending = list(self._pending), deque()
        return [item.job.done for item in waiting]

    def _slice(self, budget: int) -> bool:
        batch = self._take(budget)
        if batch:
            self._embed(batch)
        return bool(batch)

    def _take(self, budget: int) -> list[_Input]:
        """The oldest inputs whose padded batch (rows x longest) fits `budget` (at least one);
        inputs of departed clients are dropped on the way."""
        batch: list[_Input] = []
        longest = 0
        dropped = 0
        with self._lock:
            while self._pending:
                item = self._pending[0]
                if item.job.cancelled.is_set() or item.job.done.done():  # gone, or failed
                    self._pending.popleft()
                    dropped += 1
                    continue
                wider = max(longest, len(item.tokens))
                if batch and wider * (len(batch) + 1) > budget:
                    break
                batch.append(self._pending.popleft())
                longest = wider
        if dropped:
            self._count("dropped", dropped)
        return batch

    def _embed(self, batch: list[_Input]) -> None:
        model = self.engine.model
        try:
            assert model is not None, "the engine has no model"
            rows = [item.tokens for item in batch]
            if self.pooling == ENCODER:
                pad = getattr(self.engine.tokenizer, "pad_token_id", None)
                vectors = encode_rows(model, rows, pad if isinstance(pad, int) else 0)
            else:
                vectors = embed_rows(model, rows, self.pooling)
        except Exception as exc:  # the requests of this batch fail; the engine goes on
            log.exception("an embedding batch of %d inputs failed", len(batch))
            for item in batch:
                if not item.job.done.done():
                    item.job.done.set_exception(exc)
            return
        self.batches += 1
        self._count("embedded", len(batch))
        for item, vector in zip(batch, vectors, strict=True):
            job = item.job
            job.vectors[item.index] = vector
            job.left -= 1
            if job.left == 0 and not job.done.done():
                job.done.set_result([v for v in job.vectors if v is not None])
