"""A small model with the target's tokenizer as a draft source, batched. ENGINE THREAD.

Lookup sources guess only what was already written; a draft model guesses prose too. It costs
forward passes, so they are shared: every row that wants a draft this step runs in one batch,
one draft-model forward per draft position for all of them (mlx-lm's draft model runs one
sequence, and turns batching off). Each row drafts greedily up to its own depth (the batch runs
to the deepest; a shallower row's extra tokens are given back next step), and verify.py keeps
the answer the target's own, greedy or sampled.

The draft model's KV is one `HoleKVCache` per layer (engine/speculation/holes.py), a row per
member. Each row knows the tokens its KV holds (`held`) and the row's committed tokens (its
`DraftSource.extend`), so a step first gives back what the target did not keep (the rejected
drafts: holes, no copy), then feeds every member what it has not seen (the accepted drafts'
last and the bonus token; after plain steps, the tokens they emitted), right-padded to the
longest backlog in one pass, the padding given back the same way. A row joins lazily, once its
controller asks for a draft: its tokens so far are prefilled on their own, a chunk per step (a
long prompt does not stall the other rows), and merged in (a request that never drafts never
pays it). A row leaves when the decode batch forgets
it. The holes are compacted (each row's valid slots gathered) once they outnumber the tokens.

All of it runs inside the speculative step, which the decode batch times whole, so the verify
cost (`VerifyCost`, depth.py) each depth is weighed against includes the draft model's passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_kvserve.engine.speculation.depth import VerifyCost
from mlx_kvserve.engine.speculation.drafts import Draft, Drafter
from mlx_kvserve.engine.speculation.holes import HoleKVCache
from mlx_kvserve.models.draft import vocabulary_problem

log = logging.getLogger("mlx_kvserve.engine")

# Runs on the engine thread, after the model's own loader: the draft model and its tokenizer.
DraftLoader = Callable[[], tuple[nn.Module, TokenizerWrapper]]

NAME = "draft_model"
# Beside prompt lookup a draft wins over a 2-token match and loses to 3 and 4 (a tie goes to the
# row's own tokens, asked first): a copy that long is the better guess. A model whose drafts are
# seldom kept drops to WEAK, below every match.
EVIDENCE = 3
WEAK = 1


@dataclass(eq=False)
class DraftModelRow:
    """One row's `DraftSource`: its committed tokens, what its draft KV holds, its last draft."""

    tokens: list[int] = field(default_factory=list)  # committed: prompt, then accepted output
    held: list[int] = field(default_factory=list)  # the tokens in its row of the draft KV
    settled: int = 0  # held[:settled] are known to be committed
    draft: tuple[int, ...] = ()
    evidence: int = EVIDENCE  # the model's standing when `draft` was made
    drafted_at: int = -1  # len(tokens) when `draft` was made
    name: str = NAME

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, limit: int) -> Draft | None:
        """The batch's draft for this row, if it was made for its tokens as they are now."""
        if limit <= 0 or not self.draft or self.drafted_at != len(self.tokens):
            return None
        return Draft(self.draft[:limit], NAME, self.evidence)

    def backlog(self) -> tuple[int, list[int]]:
        """(held tokens to give back, committed tokens to feed): the held tokens past the
        common prefix go; at least the last committed token is fed (its logits draft)."""
        settled, held, tokens = self.settled, self.held, self.tokens
        limit = min(len(held), len(tokens) - 1)
        while settled < limit and held[settled] == tokens[settled]:
            settled += 1
        self.settled = settled
        return len(held) - settled, tokens[settled:]


class DraftModel:
    """The draft model and the KV of the rows it drafts for, shared by a decode batch."""

    def __init__(self, model: nn.Module, prefill_step: int = 512, prior: float = 0.25) -> None:
        """`prior`: a draft pass's cost over a plain pass of the model until both are timed
        (`load_draft`: the ratio of their parameter counts)."""
        if not all(type(c) is KVCache for c in make_prompt_cache(model)):
            raise ValueError("a draft model must have plain attention layers (KVCache) only")
        self.model = model
        self.prefill_step = prefill_step
        self.prior = prior
        self._pass_seconds: dict[int, float] = {}  # rows in the pass -> smoothed seconds
        self._spent = 0.0  # seconds in draft passes since `take_seconds`
        self._tried = self._kept = 0.0  # decayed rounds drafted from it, and first drafts kept
        self.members: list[DraftModelRow] = []  # row i of `cache`
        self.joining: dict[int, tuple[DraftModelRow, list[KVCache]]] = {}  # prefilling
        self.cache: list[HoleKVCache] | None = None
        self.passes = 0  # draft-model forwards run (prefills of joining rows included)

    def row(self) -> DraftModelRow:
        return DraftModelRow()

    def forget(self, alive: Sequence[DraftModelRow]) -> None:
        """Drop the rows that left the decode batch."""
        live = {id(a) for a in alive}
        self.joining = {k: v for k, v in self.joining.items() if k in live}
        keep = [i for i, m in enumerate(self.members) if any(m is a for a in alive)]
        if len(keep) == len(self.members):
            return
        self.members = [self.members[i] for i in keep]
        if not keep:
            self.cache = None
            return
        assert self.cache is not None
        for c in self.cache:
            c.filter(keep)

    def wanted(self, drafter: Drafter) -> bool:
        """Whether a row would take this model's draft: no free source has as good a guess
        (their evidence ties or beats the model's: a 3- or 4-token match of its own tokens, or
        any match while the model's drafts are seldom kept)."""
        free = drafter.propose(1)
        return free is None or free.source == NAME or free.evidence < self.evidence()

    def evidence(self) -> int:
        """`EVIDENCE` while the model's first drafts are kept at least half the time (decayed,
        over every row; the prior: half), else `WEAK`: then any match of a row's own tokens goes
        first, so a model that guesses badly cannot displace a copy."""
        rate = (self._kept + 1.0) / (self._tried + 2.0)
        return EVIDENCE if rate >= 0.5 else WEAK

    def record(self, drafted: int, kept: int) -> None:
        """A row's draft from this model: `drafted` tokens, `kept` of them."""
        if drafted:
            self._tried = 0.95 * self._tried + 1
            self._kept = 0.95 * self._kept + (kept > 0)

    def cost(self, verify: VerifyCost, batch: int) -> Callable[[int], float]:
        """c(w) for a row drafting w - 1 tokens with this model: the verify pass's (`verify`)
        plus w - 1 draft passes, each over a plain pass of the model as timed (else `prior`)."""
        plain = verify.plain(batch)
        rows = len(self.members) or 1
        near = sorted(self._pass_seconds, key=lambda n: abs(n - rows))  # the rows timed nearest
        timed = self._pass_seconds[near[0]] if near else None
        ratio = timed / plain if timed and plain else self.prior

        def cost(width: int) -> float:
            return verify.cost(batch, width) + max(0, width - 1) * ratio

        return cost

    def take_seconds(self) -> float:
        """Seconds spent drafting since the last call (the step's time less these is the
        verify pass's, for `VerifyCost`)."""
        spent, self._spent = self._spent, 0.0
        return spent

    def draft(self, wanted: Sequence[tuple[DraftModelRow, int]], vocab: int) -> None:
        """Draft `depth` tokens for each (row, depth) with a positive depth (its `propose` then
        returns them), in one draft-model pass per position over every member."""
        depth = max((d for _, d in wanted), default=0)
        if depth <= 0:
            return
        started = time.perf_counter()
        try:
            self._draft(wanted, depth, vocab)
        except BaseException:  # the batch's KV may be half updated: every row starts afresh
            self.members, self.cache, self.joining = [], None, {}
            raise
        finally:
            self._spent += time.perf_counter() - started

    def _draft(self, wanted: Sequence[tuple[DraftModelRow, int]], depth: int, vocab: int) -> None:
        for row, d in wanted:
            if d > 0 and not any(row is m for m in self.members):
                self._join(row)
        joined = {id(m) for m in self.members}
        depth = max((d for row, d in wanted if id(row) in joined), default=0)
        if self.cache is None or depth <= 0:
            return  # every row that wants a draft is still prefilling
        started = time.perf_counter()
        rows = self.members
        gone, feeds = zip(*(m.backlog() for m in rows), strict=True)
        for c in self.cache:
            c.rollback(list(gone))
        for m, g in zip(rows, gone, strict=True):
            del m.held[len(m.held) - g :]
        self._compact()
        width = max(len(f) for f in feeds)
        inputs = mx.array([f + [f[-1]] * (width - len(f)) for f in feeds], dtype=mx.uint32)
        logits = self.model(inputs, cache=self.cache)
        self.passes += 1
        last = mx.array([len(f) - 1 for f in feeds])
        logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0, :vocab]
        for c in self.cache:
            c.rollback([width - len(f) for f in feeds])
        for m, f in zip(rows, feeds, strict=True):
            m.held.extend(f)
        out = [mx.argmax(logits, axis=-1)]
        for _ in range(depth - 1):  # one pass per position, every member in it
            logits = self.model(out[-1][:, None], cache=self.cache)[:, -1, :vocab]
            self.passes += 1
            out.append(mx.argmax(logits, axis=-1))
        drafts = mx.stack(out, axis=1).tolist()
        per_pass = (time.perf_counter() - started) / depth  # a catch-up pass, depth - 1 more
        old = self._pass_seconds.get(len(rows))
        self._pass_seconds[len(rows)] = per_pass if old is None else 0.8 * old + 0.2 * per_pass
        wants = {id(row): d for row, d in wanted}
        for m, tokens in zip(rows, drafts, strict=True):
            m.held.extend(tokens[:-1])
            m.draft = tuple(tokens[: wants.get(id(m), 0)])
            m.evidence = self.evidence()
            m.drafted_at = len(m.tokens)

    # ------------------------------------------------------------------------------------
    def _join(self, row: DraftModelRow) -> None:
        """Prefill one more chunk of the row's committed tokens but the last (the step feeds
        that one) on caches of its own, and merge them into the batch once they hold them all:
        a long prompt does not stall every other row's step."""
        _, caches = self.joining.setdefault(id(row), (row, make_prompt_cache(self.model)))
        done = caches[0].offset
        chunk = row.tokens[done : min(done + self.prefill_step, len(row.tokens) - 1)]
        assert chunk or done, "a row joins with at least two committed tokens"
        if chunk:
            self.model(mx.array([chunk], dtype=mx.uint32), cache=caches)
            mx.eval([c.state for c in caches])
            self.passes += 1
            done += len(chunk)
        if done < len(row.tokens) - 1:
            return
        del self.joining[id(row)]
        row.held, row.settled = row.tokens[:done], done
        merged = [HoleKVCache.adopt(BatchKVCache.merge([c])) for c in caches]
        if self.cache is None:
            self.cache = merged
        else:
            for c, new in zip(self.cache, merged, strict=True):
                c.extend(new)
        self.members.append(row)

    def _compact(self) -> None:
        """Gather each row's valid slots once the buffer holds more holes than tokens."""
        assert self.cache is not None
        longest = max(len(m.held) for m in self.members)
        if self.cache[0]._idx <= 2 * longest + 64:
            return
        self.cache = [
            HoleKVCache.adopt(BatchKVCache.merge([c.extract(i) for i in range(len(self.members))]))
            for c in self.cache
        ]


def load_draft(
    loader: DraftLoader | None,
    target: nn.Module,
    tokenizer: object,
    prefill_step: int,
    speculation: str,
) -> DraftModel | None:
    """The engine's draft model for `target` (None without a loader, or with speculation
    off); ValueError if it cannot draft for a model of `tokenizer` (another vocabulary, or
    windows). Its passes are first assumed to cost their share of the target's parameters."""
    if loader is None or speculation != "auto":
        return None
    model, draft_tokenizer = loader()
    problem = vocabulary_problem(tokenizer, draft_tokenizer)
    if problem:
        raise ValueError(f"the draft model cannot draft for this model: {problem}")
    prior = min(1.0, parameters(model) / max(1, parameters(target)))
    log.info(
        "speculation drafts with a draft model too (%.0f%% of the model's parameters)", 100 * prior
    )
    return DraftModel(model, prefill_step, prior)


def parameters(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))
