"""The engine's side of admission: the ledger of engine/ledger.py applied to live requests.

ENGINE THREAD. The arithmetic (what a request holds, when it may grow, whom to pause) is the
pure `Ledger`; this module feeds it what the engine sees (prompt lengths, the batch's rows and
their lengths, the resident sessions, the prompt cache's host copies) and carries out its
decisions: drop resident sessions and RAM-tier copies before pausing anyone, pause a decoding
sequence (checkpoint its KV, free it) and resume it later (restore from the checkpoint, prefill
what the cache did not keep, rejoin the batch where it left off: its sampled token, grammar,
detokenizer and stop matcher were never touched). Holds are keyed by request id.

Under contention the resident session a request is about to take (its conversation's previous
turn, kept in place) is counted once, as the request's own KV, and is not shed: the others go
first, then the RAM tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from collections.abc import Generator as Generator_
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.engine import faults
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.blame import check_logits, recover
from mlx_kvserve.engine.chunks import Checkpoints
from mlx_kvserve.engine.decode import Cancelled
from mlx_kvserve.engine.generate import Live, PrefillTask, Timings, prefill_steps
from mlx_kvserve.engine.image_prefill import ImageRows, VisionRows, request_rows
from mlx_kvserve.engine.ledger import KVCost, LayerLike, Ledger
from mlx_kvserve.engine.namespaces import Caches, States, caches_of
from mlx_kvserve.engine.prompt_state import Start
from mlx_kvserve.engine.requests import GenerationRequest
from mlx_kvserve.engine.sequence import Sequence
from mlx_kvserve.engine.speculation.mtp import prefill_source

log = logging.getLogger("mlx_kvserve.engine")

T = TypeVar("T")
Decide = Callable[[Callable[[], T]], T]  # a turn's `decide` (engine/lockstep.py): rank 0's


def _own(decide: Callable[[], T]) -> T:
    return decide()


class Room:
    """Who holds how much KV, and the pauses that keep it within the budget."""

    def __init__(
        self,
        layers: Iterable[LayerLike],
        budget: int,
        states: States,
        prompt_cache: Caches,
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
        self._fixed = 0  # the copies no one can drop, as last counted (for other threads)

    # -- admission ------------------------------------------------------------------------------
    def fits_alone(self, req: GenerationRequest) -> bool:
        """Whether `req` could ever run here (any thread: reads the last count of the copies
        that cannot be dropped, not the engine's ledger)."""
        return self.ledger.fits_alone(len(req.prompt_tokens), self._fixed)

    def too_large(self, req: GenerationRequest) -> str:
        """Worded as a context overflow (Claude Code reads "prompt is too long" and compacts)."""
        most = self.ledger.most_tokens(self._fixed)
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
        if shortfall and busy:
            reused = self.states.reusable(req.prompt_tokens, req.namespace, req.image_spans)
            if reused is not None:  # it moves into the request: counted once, as its prompt
                shortfall = self._shortfall(req, reused)
            if shortfall and self._shed(shortfall, keep=reused):
                shortfall = self._shortfall(req, reused)
        if shortfall and busy:
            return False
        self.take(req)
        return True

    def take(self, req: GenerationRequest) -> None:
        """Charge `req` its prompt and first reserve: once admitted here, or, on the other
        ranks of a job, once rank 0 admitted it (they follow its decisions)."""
        self.ledger.admit(req.request_id, len(req.prompt_tokens), req.params.max_tokens)

    def _shortfall(self, req: GenerationRequest, reused: Start | None = None) -> int:
        self.refresh(reused)
        return self.ledger.shortfall(len(req.prompt_tokens), req.params.max_tokens)

    def release(self, req: GenerationRequest) -> None:
        """`req` holds nothing any more (ended, failed, or its prefill was cancelled)."""
        self.ledger.finish(req.request_id)
        self.last = self.ledger.report()

    def forget(self, request_ids: set[str]) -> list[Sequence]:
        """After a failure: these requests leave the paused list and the ledger; their paused
        sequences."""
        gone = [seq for seq, _ in self.paused if seq.req.request_id in request_ids]
        self.paused = [(s, o) for s, o in self.paused if s.req.request_id not in request_ids]
        for request_id in request_ids:
            self.ledger.finish(request_id)
        self.last = self.ledger.report()
        return gone

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
            rid = seq.req.request_id
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
            s.req.request_id: len(s.req.prompt_tokens) + s.req.params.max_tokens + 1
            for s in batch.seqs
        }
        orders = {rid: hold.order for rid, hold in holds.items()}
        paused, full = self.ledger.plan_step(needs, needs.keys(), limits)
        ends = []
        for rid in full:
            if self._drain_copies() and self.ledger.grow(rid, needs[rid], limits.get(rid)):
                continue  # the copies beside it were in the way, not its own KV
            ends.append(str(rid))
        return ends, [(str(rid), orders[rid]) for rid in paused]

    def _pause(self, seq: Sequence, batch: DecodeBatch, order: int) -> None:
        """Take `seq` out of the batch, checkpoint its KV and free it."""
        faults.maybe_fail("pause")
        batch.take(seq)
        cache = seq.states.cache
        held = seq.live.key()  # the tokens as the cache keys them (images by their content)
        if cache is not None and held and not seq.req.choice:  # a fork: see finish
            cache.checkpoint(held, seq.live.caches, "pause", probe=seq.last_logits)
        seq.live.caches, seq.live.mtp = [], None  # the MTP's too: its resumption feeds a new one
        self.paused.append((seq, order))
        self.pauses += 1
        log.info(
            "request %s paused at %d tokens: the KV budget is full (%d paused)",
            seq.req.request_id,
            len(seq.live.tokens),
            len(self.paused),
        )

    # -- resuming -------------------------------------------------------------------------------
    def next_paused(self) -> Sequence | None:
        """The paused sequence that resumes first (the oldest), if any."""
        return min(self.paused, key=lambda p: p[1])[0] if self.paused else None

    def next_resume(
        self,
        model: nn.Module,
        prefill_step: int,
        busy: bool,
        decide: Decide = _own,
        vision: VisionRows | None = None,
    ) -> PrefillTask | None:
        """The oldest paused sequence's resumption, if it fits now (or nothing else runs);
        `vision`: a vision model's tower, which embeds the prompt's images again."""
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
        self.ledger.admit(seq.req.request_id, len(seq.live.tokens), left, order=order)
        self.resumes += 1
        images = request_rows(vision, model, seq.req.image_spans, seq.req.images)
        return PrefillTask(seq.req, _resume(model, seq, prefill_step, images))

    def cancel_paused(self) -> list[Sequence]:
        """Paused sequences whose client went away: they leave now (the caller ends them)."""
        gone = [seq for seq, _ in self.paused if seq.req.cancelled.is_set()]
        self.paused = [(s, o) for s, o in self.paused if not s.req.cancelled.is_set()]
        return gone

    # -- the other copies -----------------------------------------------------------------------
    def refresh(self, reused: Start | None = None) -> None:
        """Read the copies that share the memory: resident sessions (but `reused`, which a
        request being admitted is about to take), RAM tier, queued writes."""
        residents = self.states.resident_bytes - (reused.nbytes if reused is not None else 0)
        self.ledger.set_extra("resident_sessions", residents)
        ram = pending = 0
        for cache in caches_of(self.prompt_cache):
            parts = cache.memory()
            ram += parts["ram_tier"]
            pending += parts["pending_writes"]
        self.ledger.set_extra("ram_tier", ram)
        self.ledger.set_extra("pending_writes", pending)
        self._fixed = self.ledger.fixed_extras()
        self.last = self.ledger.report()

    def _shed(self, nbytes: int, keep: Start | None = None) -> bool:
        """Drop resident sessions (all but `keep`), then RAM-tier copies, to free `nbytes`;
        whether any went."""
        freed = self.states.drop_residents(keep)  # their KV is in the prompt cache
        for cache in caches_of(self.prompt_cache):
            if freed < nbytes:
                freed += cache.release_ram(nbytes - freed)
        self.refresh(keep)
        return freed > 0

    def _drain_copies(self) -> bool:
        """Alone and out of room: drop every copy that can go and wait for the queued host
        copies to reach the disk (pauses queue them); whether anything was freed."""
        before = self.ledger.total()
        self._shed(before)
        for cache in caches_of(self.prompt_cache):
            cache.flush()
            cache.release_ram(cache.memory()["ram_tier"])
        self.refresh()
        return self.ledger.total() < before

    def report(self) -> dict[str, int]:
        """Read afresh (engine thread); other threads read `last`, a copy made here."""
        self.refresh()
        return {**self.last, "paused": len(self.paused)}


def _resume(
    model: nn.Module, seq: Sequence, step: int, images: ImageRows | None = None
) -> Generator_[int, None, tuple[Timings, Sequence]]:
    """Rebuild the caches of a paused sequence (its checkpoint, else cold) for exactly its
    `live.tokens`; the logits of that prefill are only checked (the sequence kept its next
    token). A failure is blamed and tried again as a request's prefill is (engine/blame.py)."""
    states, tokens, spans = seq.states, list(seq.live.tokens), seq.live.spans
    timings = Timings(prompt_tokens=len(tokens))  # the resumption's own: not the request's

    def attempt(start: Start) -> Generator_[int, None, Live]:
        live = Live(start.caches, list(start.tokens), spans)
        speculative = seq.req.params.speculative
        live.mtp = prefill_source(model, live.tokens, speculative, start.restored_mtp)

        def check() -> None:
            if seq.req.cancelled.is_set():
                raise Cancelled

        try:
            if len(live.tokens) < len(tokens):
                checkpoints = Checkpoints({}, 0, _no_store, spans=spans)
                logits = yield from prefill_steps(
                    model, live, tokens, step, checkpoints, check, images
                )
                check_logits(logits)
        except Cancelled:
            seq.cancel()
        return live

    if not tokens:
        seq.live = Live(states.fresh(), [], spans)
        return timings, seq
    who = f"request {seq.req.request_id} (resuming)"
    seq.live = yield from recover(states, tokens, who, attempt, timings, spans)
    return timings, seq


def _no_store(live: Live, last_logits: mx.array | None, **_kwargs: object) -> None:
    """A resumption stores no checkpoints: its tokens were checkpointed when it paused."""
