"""Where the ranks of a job agree: rank 0's engine decides, every rank's engine does the same.

ENGINE THREAD. Across several machines every rank holds a shard of the model and runs the same
engine loop (engine/worker.py) over its own caches; each forward pass sums its partial results
with the other ranks', so every rank must run the same passes on the same rows, in the same
order. Everything in the loop that is deterministic (the batch's merges and departures,
grammars, stop strings, seeded sampling over logits that are equal on every rank after the
all-reduce) happens alike by itself. What is not is decided on rank 0 alone and shared:

- the next request, taken from rank 0's HTTP queue (or the order to stop);
- cancellations: a client that leaves sets its request's flag on rank 0 at any moment, so rank
  0 *latches* the flags once a turn (`CancelLatch`) and sends the newly set ones;
- what timing and memory choose: the next prefill chunk or decode step (engine/schedule.py),
  a paused request's resumption, and whom a step pauses or ends for memory (engine/room.py).

A turn's decisions travel together, in one collective, right before the turn's first forward
pass (`flush`): rank 0 decides and applies them as it goes, while the others wait for the list
at their first decision of the turn and replay it. The list also carries a digest of the
batch, so a rank that has drifted stops the job with a clear line instead of answering
garbage. `Solo` is the same interface for one process: every decision is its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from mlx_kvserve.engine.requests import CancelLatch
from mlx_kvserve.engine.stopping import STOP

WORK_TIMEOUT = 300.0  # seconds one prefill chunk or decode step may take across the ranks


class Agreement(Protocol):
    """What the engine asks of the job it belongs to."""

    leader: bool  # takes requests, decides; a rank > 0 follows
    distributed: bool

    def tick(self, requests: Iterable[Any], digest: list[int]) -> None: ...
    def next_item(self, take: Callable[[], Any]) -> Any: ...
    def decide(
        self,
        decide: Callable[[], Any],
        encode: Callable[[Any], Any] = ...,
        decode: Callable[[Any], Any] = ...,
    ) -> Any: ...
    def flush(self) -> None: ...
    def all_true(self, flag: bool, what: str) -> bool: ...
    def working(self, what: str) -> AbstractContextManager[Any]: ...


def _same(value: Any) -> Any:
    return value


class Solo:
    """One process: every decision is its own, nothing travels."""

    leader = True
    distributed = False

    def tick(self, requests: Iterable[Any], digest: list[int]) -> None:
        """Nothing to latch: a cancellation takes effect wherever the engine reads it."""

    def next_item(self, take: Callable[[], Any]) -> Any:
        return take()

    def decide(
        self,
        decide: Callable[[], Any],
        encode: Callable[[Any], Any] = _same,
        decode: Callable[[Any], Any] = _same,
    ) -> Any:
        return decide()

    def flush(self) -> None:
        """Nothing to send."""

    def all_true(self, flag: bool, what: str) -> bool:
        return flag

    def working(self, what: str) -> AbstractContextManager[Any]:
        return nullcontext()


class Diverged(RuntimeError):
    """This rank's engine is no longer doing what rank 0's does."""


class RequestWire(Protocol):
    """A request as rank 0 sends it (JSON), and as another rank rebuilds it."""

    def encode(self, req: Any) -> dict[str, Any]: ...
    def decode(self, wire: dict[str, Any]) -> Any: ...


class Lockstep:
    """Rank 0 (`leader`) or another rank of a job; see the module's docstring."""

    distributed = True

    def __init__(self, collective: Any, wire: RequestWire, timeout: float = WORK_TIMEOUT) -> None:
        self.collective = collective
        self.leader: bool = collective.is_leader
        self.wire = wire
        self.timeout = timeout
        self._requests: dict[str, Any] = {}  # the others: this turn's requests by id
        self.cache: Any = None  # this rank's prompt cache, whose budget evictions rank 0 decides
        self._turn: dict[str, Any] | None = None  # rank 0: this turn's list, until sent
        self._replay: list[Any] | None = None  # the others: this turn's list, being replayed
        self.turns = 0

    def attach_cache(self, cache: Any) -> None:
        """This rank's prompt cache: on the other ranks, its disk budget follows rank 0's."""
        self.cache = cache
        if cache is not None and not self.leader:
            cache.follow_evictions()

    def tick(self, requests: Iterable[Any], digest: list[int]) -> None:
        """A turn starts. Rank 0 latches its requests' cancellations and collects what its
        disk budget evicted during the last turn, for the others to evict alike."""
        self.turns += 1
        if not self.leader:
            self._replay = None
            self._digest = digest
            self._requests = {r.request_id: r for r in requests}
            return
        cancel = [r.request_id for r in requests if _latch(r)]
        evicted = self.cache.take_budget_evictions() if self.cache is not None else []
        self._turn = {"cancel": cancel, "digest": digest, "evicted": evicted, "decisions": []}

    def next_item(self, take: Callable[[], Any]) -> Any:
        """The turn's first decision: a new request (rank 0 takes it from its queue), the
        order to stop, or nothing."""
        return self.decide(take, self._encode_item, self._decode_item)

    def _encode_item(self, item: Any) -> Any:
        if item is None:
            return None
        if item is STOP:
            return "stop"
        return self.wire.encode(item)

    def _decode_item(self, item: Any) -> Any:
        if item is None:
            return None
        if item == "stop":
            return STOP
        return self.wire.decode(item)

    def decide(
        self,
        decide: Callable[[], Any],
        encode: Callable[[Any], Any] = _same,
        decode: Callable[[Any], Any] = _same,
    ) -> Any:
        """Rank 0: `decide()`, noted for the others. The others: rank 0's value, `decode`d."""
        if self.leader:
            assert self._turn is not None, "a decision after the turn's list was sent"
            value = decide()
            self._turn["decisions"].append(encode(value))
            return value
        self._receive()
        assert self._replay is not None
        if not self._replay:
            self._diverged("it asked for more decisions than rank 0 made")
        return decode(self._replay.pop(0))

    def flush(self) -> None:
        """Before the turn's first forward pass, and at its end: the list goes out."""
        if self.leader:
            if self._turn is not None:
                self.collective.share(self._turn, "the engine's turn")
                self._turn = None
            return
        self._receive()
        if self._replay:
            self._diverged("it skipped decisions rank 0 made")

    def all_true(self, flag: bool, what: str) -> bool:
        """Whether `flag` holds on every rank (what their shards of the model can do)."""
        return self.collective.all_true(flag, what)

    def gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's `value` (JSON), in rank order: what each would do (engine/job_states)."""
        return self.collective.gather(value, what)

    def working(self, what: str) -> AbstractContextManager[Any]:
        """A forward pass across the ranks: one that never ends ends the job."""
        return self.collective.deadline(what, self.timeout)

    def _receive(self) -> None:
        if self._replay is not None:
            return
        turn = self.collective.share(None, "the engine's turn")
        if turn["digest"] != self._digest:
            self._diverged(
                f"its batch differs from rank 0's ({self._digest} against {turn['digest']})"
            )
        for request_id in turn["cancel"]:
            req = self._requests.get(request_id)
            if req is not None:
                req.cancelled.set()
        if self.cache is not None:
            self.cache.drop_alike(turn["evicted"])
        self._replay = list(turn["decisions"])

    def _diverged(self, why: str) -> None:
        message = f"rank {self.collective.rank} no longer steps with rank 0: {why}"
        self.collective.end_job(message)
        raise Diverged(message)


def _latch(req: Any) -> bool:
    flag = req.cancelled
    return isinstance(flag, CancelLatch) and flag.latch()


__all__ = ["Agreement", "Diverged", "Lockstep", "RequestWire", "Solo"]
