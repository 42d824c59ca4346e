"""What a failed prefill is blamed on, and where the request is tried again (DESIGN invariant 5).

ENGINE THREAD. A prefill that starts from reused state (a checkpoint restored from RAM or disk,
a resident session) can fail because of that state, or for a reason that is nobody's state.
Blame goes to the least that explains the failure, and the request is tried again until it
has its normal answer:

- **the state's** (`STATE`: non-finite logits, a checksum, shape or format error, a failed
  behaviour probe) and **unknown** errors (`UNKNOWN`): the newest link of the restored chain is
  blamed and the request is tried again from its parent, which is still cached. A failure of
  the state's kind that repeats blames the next link up; an unknown one that repeats blames
  nothing more (it says nothing about the links a shared system prompt lives in). After
  `REUSED_TRIES` tries from reused state the next one is cold. A resident session that fails
  is simply gone (it was taken out of the residents); the next try looks again.
- **a cold try that fails** was not failed by any cache: nothing blamed is evicted, and the
  error is the request's (the client gets a clean error). Every try's logits are checked, a
  cold one's too.
- **memory** (`MEMORY`, `cache.exceptions.out_of_memory`: Metal's "Insufficient Memory", an
  allocator's limit): resident sessions, RAM-tier copies that are also on disk and MLX's buffer
  cache are dropped, and the request is tried again from the same start, once; nothing is
  evicted.

Blamed links are evicted, with what depends on them (the checkpoints the failed tries stored on
top of them too), only once a later try has succeeded, so a failure that also happens cold
evicts nothing. Nothing is barred: a later checkpoint of the same tokens (often this request's
own, after its answer) stores their state afresh. A restore that fails inside the cache
(`CacheRestoreError`, which the cache raises for any error but memory) has already evicted the
link it names and gone on from what is left (engine/prompt_state.py).

Across the ranks of a job every rank runs this alike: each try's start is agreed (engine/
job_states.py), a failure after it (non-finite logits, an injected fault) happens on every rank
alike, and what is blamed is a link at the same positions on each rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from collections.abc import Generator as Generator_
from dataclasses import dataclass
from typing import Protocol, TypeVar

import mlx.core as mx

from mlx_kvserve.cache import CacheError
from mlx_kvserve.cache.exceptions import out_of_memory
from mlx_kvserve.cache.state import StateError
from mlx_kvserve.engine.decode import Cancelled
from mlx_kvserve.engine.live import Timings
from mlx_kvserve.engine.positions import Shift
from mlx_kvserve.engine.prompt_state import Start
from mlx_kvserve.images.spans import ImageSpan

log = logging.getLogger("mlx_kvserve.engine")

STATE, MEMORY, UNKNOWN = "state", "memory", "unknown"
REUSED_TRIES = 3  # tries from reused state: the first, then from below each link blamed
MEMORY_RETRIES = 1  # tries again after running out of memory

T = TypeVar("T")


class StateFailed(Exception):
    """The reused state fails a check once restored: its prefill's logits are not finite."""


class States(Protocol):
    """What recovery asks of `PromptStates` (or a job's `JobStates`)."""

    def acquire(
        self,
        prompt: list[int],
        *,
        at_most: int | None = None,
        spans: Sequence[ImageSpan] = (),
        shift: Shift | None = None,
    ) -> Start: ...
    def newest_link(self, start: Start) -> tuple[str, int] | None: ...
    def evict_link(self, key: str, why: str) -> None: ...
    def free_memory(self) -> None: ...


def blame_of(exc: BaseException) -> str:
    """`MEMORY`, `STATE` or `UNKNOWN`: what `exc` says about the state a try started from."""
    if out_of_memory(exc):
        return MEMORY
    if isinstance(exc, (StateFailed, CacheError, StateError)):
        return STATE
    return UNKNOWN


def check_logits(logits: mx.array) -> None:
    """Raise `StateFailed` unless every logit of the prefill's last position is finite."""
    if not bool(mx.all(mx.isfinite(logits)).item()):
        raise StateFailed("non-finite logits")


@dataclass
class Blamed:
    key: str
    first: int  # the link's first position: the next try starts at most here
    kind: str
    why: str


class Recovery:
    """One request's tries at a prefill: where each starts, what each failure blames."""

    def __init__(
        self,
        states: States,
        prompt: list[int],
        who: str,
        spans: Sequence[ImageSpan] = (),
        shift: Shift | None = None,
    ) -> None:
        self.states = states
        self.prompt = prompt
        self.spans = spans  # where the prompt's images sit (the cache keys them by content)
        self.shift = shift  # the rope shift at a position (Qwen's M-RoPE after an image)
        self.who = who  # "request <id>", for the log
        self.at_most: int | None = None  # the next try starts at most here (0: cold)
        self.blamed: list[Blamed] = []  # newest first; evicted once a try succeeds
        self.reused_failures = 0
        self.memory_failures = 0
        self.failed_source: str | None = None  # where the first failed try started from

    def start(self) -> Start:
        return self.states.acquire(
            self.prompt, at_most=self.at_most, spans=self.spans, shift=self.shift
        )

    def failed(self, start: Start | None, exc: Exception) -> None:
        """Decide the next try after `exc` ended the one from `start` (None: it failed
        before it had a start); re-raises `exc` when no try is left."""
        kind = blame_of(exc)
        source = start.source if start is not None else "restore"
        self.failed_source = self.failed_source or source
        if kind == MEMORY:
            if self.memory_failures >= MEMORY_RETRIES:
                raise exc
            self.memory_failures += 1
            self.states.free_memory()
            self._log(start, exc, "out of memory: freed what could be freed, nothing evicted")
            return
        if start is None or not start.usable:
            if self.at_most == 0 or start is not None:
                self._log(start, exc, "it failed cold too: not the cache's, nothing evicted")
                raise exc
            self.at_most = 0  # no start to blame (the restore failed outside the cache)
            self._log(start, exc, "nothing to blame: trying cold")
            return
        self.reused_failures += 1
        link = self.states.newest_link(start)
        repeated_unknown = kind == UNKNOWN and any(b.kind == UNKNOWN for b in self.blamed)
        blame = link is not None and not repeated_unknown
        if blame:
            assert link is not None
            self.blamed.append(Blamed(*link, kind, f"{kind} failure after restoring: {exc!r}"))
            self.at_most = link[1]
        elif start.source != "live":
            self.at_most = 0  # nothing (more) to blame in the cache
        if self.reused_failures >= REUSED_TRIES:
            self.at_most = 0
        where = "cold" if self.at_most == 0 else f"from at most {self.at_most} cached tokens"
        self._log(start, exc, f"trying again {where}")

    def succeeded(self) -> None:
        """A try has its answer: the links blamed on the way go, newest first."""
        for blamed in self.blamed:
            self.states.evict_link(blamed.key, blamed.why)
        self.blamed = []

    def _log(self, start: Start | None, exc: Exception, then: str) -> None:
        where = f"{start.source}, {start.usable} cached tokens" if start is not None else "restore"
        log.warning("%s: the prefill (%s) failed: %r; %s", self.who, where, exc, then)


def recover(
    states: States,
    prompt: list[int],
    who: str,
    attempt: Callable[[Start], Generator_[int, None, T]],
    timings: Timings | None = None,
    spans: Sequence[ImageSpan] = (),
    shift: Shift | None = None,
) -> Generator_[int, None, T]:
    """Run `attempt(start)` (a prefill, resumed chunk by chunk) until one succeeds, each time
    from the start `Recovery` chooses; `timings` notes that it was retried, and from where."""
    recovery = Recovery(states, prompt, who, spans, shift)
    while True:
        start = None
        try:
            start = recovery.start()
            result = yield from attempt(start)
        except Cancelled:
            raise
        except Exception as exc:
            recovery.failed(start, exc)
            if timings is not None:
                timings.retried = True
                timings.failed_source = recovery.failed_source
            continue
        recovery.succeeded()
        return result
