"""The engine's side of admission: the ledger of engine/admission.py applied to live requests.

ENGINE THREAD. The arithmetic (what a request holds, when it may grow, whom to pause) is the
pure `Ledger`; this module feeds it what the engine sees (prompt lengths, the batch's rows and
their lengths, the resident sessions, the prompt cache's host copies) and carries out its
decisions: drop resident sessions and RAM-tier copies before pausing anyone, pause a decoding
sequence (checkpoint its KV, free it) and resume it later (restore from the checkpoint, prefill
what the cache did not keep, rejoin the batch where it left off: its sampled token, grammar,
detokenizer and stop matcher were never touched).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Generator as Generator_
from typing import Any

from mlx_kvserve.engine.admission import KVCost, Ledger
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.decode import Cancelled
from mlx_kvserve.engine.generate import Checkpoints, Live, PrefillTask, Timings, prefill_steps
from mlx_kvserve.engine.namespaces import CacheSet
from mlx_kvserve.engine.requests import GenerationRequest
from mlx_kvserve.engine.sequence import Sequence

log = logging.getLogger("mlx_kvserve.engine")

Decide = Callable[..., Any]  # engine/lockstep.py's `decide`: rank 0's choice on every rank


def _own(decide: Callable[[], Any]) -> Any:
    return decide()


class Room:
    """Who holds how much KV, and the pauses that keep it within the budget."""

    def __init__(
        self,
        layers: Any,
        budget: int,
        states: Any,
        prompt_cache: Any,
        reserve: int,
        batched: bool,
    ) -> None:
        self.ledger = Ledger(KVCost.of(layers), budget, reserve, batched)
        self.states = states
        self.prompt_cache = prompt_cache
        self.paused: list[tuple[Sequence, int]] = []  # (sequence, its admission order)
        self.pauses = 0  # counters for /metrics
        self.resumes = 0
        self.last: dict[str, int] = self.ledger.report()  # for other threads (/health)

    # -- admission ------------------------------------------------------------------------------
    def fits_alone(self, req: GenerationRequest) -> bool:
        return self.ledger.fits_alone(len(req.prompt_tokens))

    def too_large(self, req: GenerationRequest) -> str:
        """Worded as a context overflow (Claude Code reads "prompt is too long" and compacts)."""
        most = self.ledger.most_tokens()
        return (
            f"prompt is too long: {len(req.prompt_tokens)} tokens > {max(0, most - 1)} maximum "
            f"(the KV memory this server may use, --kv-budget, holds {most} tokens and the "
            "answer needs at least one)."
        )

    def admit(self, req: GenerationRequest, busy: bool) -> bool:
        """Charge `req` its prompt and first reserve if that fits (after dropping what can be
        dropped); a request always gets in when nothing runs. Paused requests go first."""
        if self.paused:
            return False  # they resume first (even when nothing runs: see `next_resume`)
        shortfall = self._shortfall(req)
        if shortfall and busy and self._shed(shortfall):
            shortfall = self._shortfall(req)
        if shortfall and busy:
            return False
        self.take(req)
        return True

    def take(self, req: GenerationRequest) -> None:
        """Charge `req` its prompt and first reserve: once admitted here, or, on the other
        ranks of a job, once rank 0 admitted it (they follow its decisions)."""
        self.ledger.admit(id(req), len(req.prompt_tokens), req.params.max_tokens)

    def _shortfall(self, req: GenerationRequest) -> int:
        self.refresh()
        return self.ledger.shortfall(len(req.prompt_tokens), req.params.max_tokens)

    def release(self, req: GenerationRequest) -> None:
        """`req` holds nothing any more (ended, failed, or its prefill was cancelled)."""
        self.ledger.finish(id(req))
        self.last = self.ledger.report()

    # -- growth ---------------------------------------------------------------------------------
    def before_step(self, batch: DecodeBatch, decide: Decide = _own) -> None:
        """Reserve what the next decode step adds: drop copies, pause the youngest, or end a
        request that is alone and out of memory, until it fits. Across machines rank 0's
        ledger decides (`decide`) and every rank ends and pauses the same requests."""
        ends, pauses = decide(lambda: self._plan_step(batch))
        by_id = {seq.req.request_id: seq for seq in batch.seqs}
        for request_id in ends:
            log.warning("request %s: the KV budget is full: it ends", request_id)
            by_id[request_id].out_of_memory()
        for request_id, order in pauses:
            self._pause(by_id[request_id], batch, order)

    def _plan_step(self, batch: DecodeBatch) -> tuple[list[str], list[tuple[str, int]]]:
        """(the requests that end, the requests that pause with their admission order)."""
        holds = self.ledger.holds
        needs = {}
        for seq in batch.seqs:
            rid = id(seq.req)
            if rid in holds and not seq.req.cancelled.is_set():  # a cancelled one ends now
                needs[rid] = len(seq.live.tokens) + max(1, len(seq.feed)) + 1
        if all(n <= holds[rid].reserved for rid, n in needs.items()):
            return [], []  # the common case: within every reserve
        self.refresh()
        cost, reserve = self.ledger.cost, self.ledger.reserve
        growth = sum(
            cost.bytes_for(n + reserve) - cost.bytes_for(holds[r].reserved)
            for r, n in needs.items()
            if n > holds[r].reserved
        )
        if self.ledger.total() + growth > self.ledger.budget:
            self._shed(self.ledger.total() + growth - self.ledger.budget)
        limits = {
            id(s.req): len(s.req.prompt_tokens) + s.req.params.max_tokens + 1 for s in batch.seqs
        }
        orders = {rid: hold.order for rid, hold in holds.items()}
        paused, full = self.ledger.plan_step(needs, needs.keys(), limits)
        by_id = {id(seq.req): seq.req.request_id for seq in batch.seqs}
        ends = []
        for rid in full:
            if self._drain_copies() and self.ledger.grow(rid, needs[rid], limits.get(rid)):
                continue  # the copies beside it were in the way, not its own KV
            ends.append(by_id[rid])
        return ends, [(by_id[rid], orders[rid]) for rid in paused]

    def _pause(self, seq: Sequence, batch: DecodeBatch, order: int) -> None:
        """Take `seq` out of the batch, checkpoint its KV and free it."""
        batch.take(seq)
        cache = seq.states.cache
        if cache is not None and seq.live.tokens:
            cache.checkpoint(seq.live.tokens, seq.live.caches, "pause", probe=seq.last_logits)
        seq.live.caches = []
        self.paused.append((seq, order))
        self.pauses += 1
        log.info(
            "request %s paused at %d tokens: the KV budget is full (%d paused)",
            seq.req.request_id,
            len(seq.live.tokens),
            len(self.paused),
        )

    # -- resuming -------------------------------------------------------------------------------
    def next_resume(
        self, model: Any, prefill_step: int, busy: bool, decide: Decide = _own
    ) -> PrefillTask | None:
        """The oldest paused sequence's resumption, if it fits now (or nothing else runs)."""
        if not self.paused:
            return None
        self.paused.sort(key=lambda p: p[1])
        seq, order = self.paused[0]
        left = seq.limit - seq.timings.completion_tokens

        def fits() -> bool:
            if seq.req.cancelled.is_set():
                return True  # it resumes to end at once
            self.refresh()
            return not (busy and self.ledger.shortfall(len(seq.live.tokens), left))

        if not decide(fits):
            return None
        self.paused.pop(0)
        self.ledger.admit(id(seq.req), len(seq.live.tokens), left, order=order)
        self.resumes += 1
        return PrefillTask(seq.req, _resume(model, seq, prefill_step))

    def cancel_paused(self) -> list[Sequence]:
        """Paused sequences whose client went away: they leave now (the caller ends them)."""
        gone = [seq for seq, _ in self.paused if seq.req.cancelled.is_set()]
        self.paused = [(s, o) for s, o in self.paused if not s.req.cancelled.is_set()]
        return gone

    # -- the other copies -----------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the copies that share the memory: resident sessions, RAM tier, queued writes."""
        self.ledger.set_extra("resident_sessions", getattr(self.states, "resident_bytes", 0))
        ram = pending = 0
        for cache in _caches(self.prompt_cache):
            parts = cache.memory()
            ram += parts["ram_tier"]
            pending += parts["pending_writes"]
        self.ledger.set_extra("ram_tier", ram)
        self.ledger.set_extra("pending_writes", pending)
        self.last = self.ledger.report()

    def _shed(self, nbytes: int) -> bool:
        """Drop resident sessions, then RAM-tier copies, to free `nbytes`; whether any went."""
        freed = 0
        if getattr(self.states, "resident_bytes", 0):
            freed += self.states.resident_bytes
            self.states.reset()  # their KV is in the prompt cache
        for cache in _caches(self.prompt_cache):
            if freed < nbytes:
                freed += cache.release_ram(nbytes - freed)
        self.refresh()
        return freed > 0

    def _drain_copies(self) -> bool:
        """Alone and out of room: drop every copy that can go and wait for the queued host
        copies to reach the disk (pauses queue them); whether anything was freed."""
        before = self.ledger.total()
        self._shed(before)
        for cache in _caches(self.prompt_cache):
            cache.flush()
            cache.release_ram(cache.memory()["ram_tier"])
        self.refresh()
        return self.ledger.total() < before

    def report(self) -> dict[str, int]:
        """Read afresh (engine thread); other threads read `last`, a copy made here."""
        self.refresh()
        return {**self.last, "paused": len(self.paused)}


def _caches(prompt_cache: Any) -> list[Any]:
    if prompt_cache is None:
        return []
    return list(prompt_cache) if isinstance(prompt_cache, CacheSet) else [prompt_cache]


def _resume(model: Any, seq: Sequence, step: int) -> Generator_[int, None, Any]:
    """Rebuild the caches of a paused sequence (its checkpoint, else cold) for exactly its
    `live.tokens`; the logits of that prefill are not used: the sequence kept its next token."""
    states, tokens = seq.states, list(seq.live.tokens)
    timings = Timings(prompt_tokens=len(tokens))  # the resumption's own: not the request's
    start = states.acquire(tokens) if tokens else states.cold()
    for attempt in (start, None):
        start = attempt or states.cold()
        live = Live(start.caches, list(start.tokens))

        def check(live: Live = live) -> None:
            if seq.req.cancelled.is_set():
                raise Cancelled

        try:
            if len(live.tokens) < len(tokens):
                yield from prefill_steps(
                    model, live, tokens, step, Checkpoints({}, 0, _no_store), check
                )
            break
        except Cancelled:
            seq.cancel()
            break
        except Exception as exc:
            if attempt is None or not start.usable:
                raise
            # as a failed restore at a request's start: evict what failed, retry cold once
            states.evict(start, f"resuming a paused request failed: {exc!r}")
    seq.live = live
    return timings, seq


def _no_store(*_args: Any, **_kwargs: Any) -> None:
    """A resumption stores no checkpoints: its tokens were checkpointed when it paused."""
