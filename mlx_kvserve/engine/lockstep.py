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
pass: rank 0 decides and applies them as it goes, while the others wait for the list at their
first decision of the turn and replay it. The list also carries a digest of the batch: its
counts and, per row, the drafts it made and kept (speculation: engine/speculation/job.py) and
the tokens drawn so far (`Draws`: a running CRC-32), so a rank that has drifted, drafted
otherwise, or drew another token than rank 0 from logits that were not quite equal (Macs of
other generations), stops the job with a clear line instead of answering garbage.

A forward pass across the ranks has a deadline (`pass_timeout`): the peer timeout for what any
pass costs, and a generous allowance per token it computes, so a rank stuck inside a pass (a
Mac gone to sleep) ends the job in about the time a collective would.

The engine sees all this as one object per turn (`Turn`, a context manager from
`Agreement.turn`): its first decision (`next_item`), the others (`decide`), and its forward
passes (`working`: the turn's list goes out first). `Solo` is the agreement of one process,
whose turns decide everything on the spot and send nothing.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import Protocol, TypeVar

from mlx_kvserve.engine.protocols import PromptCacheView
from mlx_kvserve.engine.requests import STOP, CancelLatch, GenerationRequest, Item
from mlx_kvserve.json_value import JSON

PASS_SECONDS_PER_TOKEN = 0.25  # a pass's allowance per token, beyond the peer timeout

T = TypeVar("T")


def pass_timeout(peer_timeout: float, tokens: int) -> float:
    """Seconds a forward pass of `tokens` tokens (a prefill chunk's, or a decode step's rows)
    may take across the ranks: `peer_timeout` + 0.25 s a token. A 512-token chunk gets 158 s
    with the default 30 s, a decode step of 8 rows 32 s: several times the slowest pass of a
    big model on a Mac, far less than a stuck rank would take."""
    return peer_timeout + PASS_SECONDS_PER_TOKEN * max(1, tokens)


class Turn(Protocol):
    """One turn of the engine loop (engine/worker.py), as the ranks of its job agree on it."""

    def next_item(self, take: Callable[[], Item]) -> Item:
        """The turn's first decision: a new request, the order to stop, or None."""
        ...

    def decide(
        self,
        decide: Callable[[], T],
        encode: Callable[[T], JSON] = ...,
        decode: Callable[[JSON], T] = ...,
    ) -> T:
        """Rank 0's `decide()` on every rank (a choice timing or memory made)."""
        ...

    def working(self, what: str, tokens: int) -> AbstractContextManager[None]:
        """A forward pass of `tokens` tokens (a prefill chunk's, or a decode step's rows): the
        turn's decisions go out first; one that does not end within its deadline ends the job."""
        ...

    def __enter__(self) -> Turn: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None: ...


class Agreement(Protocol):
    """What the engine asks of the job it belongs to."""

    leader: bool  # takes requests, decides; a rank > 0 follows
    distributed: bool
    cluster: dict[str, JSON] | None  # the job's ranks, for /health

    def turn(self, requests: Iterable[GenerationRequest], digest: list[JSON]) -> Turn:
        """A turn begins; `requests` are the engine's, `digest` what its batch looks like."""
        ...

    def all_true(self, flag: bool, what: str) -> bool: ...


def _same(value: JSON) -> JSON:
    return value


class SoloTurn:
    """A turn of one process: every decision is its own, nothing travels."""

    def __enter__(self) -> SoloTurn:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def next_item(self, take: Callable[[], Item]) -> Item:
        return take()

    def decide(
        self,
        decide: Callable[[], T],
        encode: Callable[[T], JSON] = _same,
        decode: Callable[[JSON], T] = _same,
    ) -> T:
        return decide()

    def working(self, what: str, tokens: int) -> AbstractContextManager[None]:
        return nullcontext()


class Solo:
    """One process: its turns decide on the spot (`SoloTurn`)."""

    leader = True
    distributed = False
    cluster = None

    def turn(self, requests: Iterable[GenerationRequest], digest: list[JSON]) -> SoloTurn:
        """Nothing to latch: a cancellation takes effect wherever the engine reads it."""
        return SoloTurn()

    def all_true(self, flag: bool, what: str) -> bool:
        return flag


class Draws:
    """Each row's tokens drawn so far, as a running CRC-32 (request id: [count, crc]): what a
    turn's digest carries, so that a rank that drew another token than rank 0 is found at the
    next turn, not only one that drew more or fewer. Each turn hashes only the new tokens."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int]] = {}

    def of(self, requests: Iterable[GenerationRequest]) -> dict[str, list[int]]:
        seen: dict[str, tuple[int, int]] = {}
        for req in requests:
            tokens = req.sampled
            count, crc = self._seen.get(req.request_id, (0, 0))
            if count > len(tokens):  # drawn again from an earlier point: hash them all
                count, crc = 0, 0
            new = tokens[count:]
            if new:
                crc = zlib.crc32(struct.pack(f"<{len(new)}I", *new), crc)
            seen[req.request_id] = (len(tokens), crc)
        self._seen = seen
        return {request_id: list(drawn) for request_id, drawn in seen.items()}


def difference(mine: list[JSON], leader: list[JSON]) -> str:
    """Why this rank's digest is not rank 0's, naming the request that drew otherwise."""
    drawn = mine[-1] if mine and isinstance(mine[-1], dict) else {}
    theirs = leader[-1] if leader and isinstance(leader[-1], dict) else {}
    for request_id, (count, crc) in drawn.items():
        other = theirs.get(request_id)
        if other is not None and list(other) != [count, crc]:
            return (
                f"request {request_id} drew other tokens here than on rank 0 ({count} tokens, "
                f"hash {crc:08x}, against {other[0]} tokens, hash {other[1]:08x})"
            )
    kept = mine[-2] if len(mine) > 1 and isinstance(mine[-2], dict) else {}
    theirs = leader[-2] if len(leader) > 1 and isinstance(leader[-2], dict) else {}
    for request_id, counts in kept.items():
        other = theirs.get(request_id)
        if other is not None and list(other) != list(counts):
            return (
                f"request {request_id} drafted and kept other tokens here than on rank 0 "
                f"({counts[0]} drafted, {counts[1]} kept, against {other[0]} and {other[1]})"
            )
    return f"its batch differs from rank 0's ({mine} against {leader})"


class Diverged(RuntimeError):
    """This rank's engine is no longer doing what rank 0's does."""


class RequestWire(Protocol):
    """A request as rank 0 sends it (JSON), and as another rank rebuilds it."""

    def encode(self, req: GenerationRequest) -> dict[str, JSON]: ...
    def decode(self, wire: dict[str, JSON]) -> GenerationRequest: ...


class Collective(Protocol):
    """What the lockstep asks of the job's collectives (distributed/collective.py)."""

    is_leader: bool
    rank: int
    timeout: float  # the job's peer timeout (--peer-timeout)

    def share(self, message: JSON = None, what: str = ...) -> JSON: ...
    def gather(self, value: JSON, what: str = ...) -> list[JSON]: ...
    def all_true(self, flag: bool, what: str = ...) -> bool: ...
    def deadline(self, what: str, timeout: float | None = None) -> AbstractContextManager[None]: ...
    def end_job(self, message: str) -> None: ...


class Lockstep:
    """Rank 0 (`leader`) or another rank of a job; see the module's docstring.

    `cache` is this rank's prompt cache: rank 0's disk budget decides what every rank evicts
    (`PromptCache.follow_evictions` on the others). `cluster` describes the job for /health.
    """

    distributed = True

    def __init__(
        self,
        collective: Collective,
        wire: RequestWire,
        *,
        cache: PromptCacheView | None = None,
        cluster: dict[str, JSON] | None = None,
    ) -> None:
        self.collective = collective
        self.leader: bool = collective.is_leader
        self.wire = wire
        self.cache = cache
        self.cluster = cluster
        if cache is not None and not self.leader:
            cache.follow_evictions()
        self._requests: dict[str, GenerationRequest] = {}  # the others: this turn's, by id
        self._digest: list[JSON] = []
        self._turn: dict[str, JSON] | None = None  # rank 0: this turn's list, until sent
        self._replay: list[JSON] | None = None  # the others: this turn's list, being replayed
        self.turns = 0

    def turn(self, requests: Iterable[GenerationRequest], digest: list[JSON]) -> LockstepTurn:
        """A turn begins (`tick`); its list goes out before its first pass and at its end."""
        self.tick(requests, digest)
        return LockstepTurn(self)

    def tick(self, requests: Iterable[GenerationRequest], digest: list[JSON]) -> None:
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

    def next_item(self, take: Callable[[], Item]) -> Item:
        """The turn's first decision: a new request (rank 0 takes it from its queue), the
        order to stop, or nothing."""
        return self.decide(take, self._encode_item, self._decode_item)

    def _encode_item(self, item: Item) -> JSON:
        if item is None:
            return None
        if item is STOP:
            return "stop"
        return self.wire.encode(item)  # a request

    def _decode_item(self, item: JSON) -> Item:
        if item is None:
            return None
        if item == "stop":
            return STOP
        return self.wire.decode(item)

    def decide(
        self,
        decide: Callable[[], T],
        encode: Callable[[T], JSON] = _same,
        decode: Callable[[JSON], T] = _same,
    ) -> T:
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

    def gather(self, value: JSON, what: str) -> list[JSON]:
        """Every rank's `value` (JSON), in rank order: what each would do (engine/job_states)."""
        return self.collective.gather(value, what)

    def same_pass(self, shape: list[int], rows: Iterable[GenerationRequest]) -> None:
        """Before a decode pass of a job that speculates: every rank's is of rank 0's `shape`,
        or a rank > 0 ends the job, naming the request that drew otherwise if one did
        (engine/speculation/job.py `CheckedPasses`); rank 0 goes on and loses its peer."""
        shapes = self.collective.gather(shape, "a decode pass's shape")
        if all(s == shapes[0] for s in shapes):
            return
        mine = Draws().of(rows)
        leader = self.collective.share(mine if self.leader else None, "the rows' draws")
        if self.leader:
            return
        why = difference([mine], [leader])
        if why.startswith("its batch"):
            why = f"its decode pass is of shape {shape} here, {shapes[0]} on rank 0"
        self._diverged(why)

    def working(self, what: str, tokens: int) -> AbstractContextManager[None]:
        """A forward pass of `tokens` tokens across the ranks: one that does not end within
        `pass_timeout` ends the job."""
        return self.collective.deadline(what, pass_timeout(self.collective.timeout, tokens))

    def _receive(self) -> None:
        if self._replay is not None:
            return
        turn = self.collective.share(None, "the engine's turn")
        if turn["digest"] != self._digest:
            self._diverged(difference(self._digest, turn["digest"]))
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


class LockstepTurn:
    """A turn of a job's engine (see `Turn`): `Lockstep`'s calls, in the turn's order."""

    def __init__(self, job: Lockstep) -> None:
        self.job = job
        self.next_item = job.next_item  # the turn's decisions are the job's, in order
        self.decide = job.decide

    def __enter__(self) -> LockstepTurn:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:  # a turn that failed sends nothing: its engine stops (worker.py)
            self.job.flush()

    @contextmanager
    def working(self, what: str, tokens: int) -> Iterator[None]:
        self.job.flush()  # the turn's decisions go out before its first forward pass
        with self.job.working(what, tokens):
            yield


def _latch(req: GenerationRequest) -> bool:
    flag = req.cancelled
    return isinstance(flag, CancelLatch) and flag.latch()


__all__ = [
    "Agreement",
    "Diverged",
    "Draws",
    "Lockstep",
    "LockstepTurn",
    "RequestWire",
    "Solo",
    "SoloTurn",
    "Turn",
    "pass_timeout",
]
