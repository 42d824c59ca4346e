"""A decode step that drafts and verifies: prompt lookup on attention-only rows.

`DecodeBatch.step` (engine/batch.py) asks `Speculator.step` first; it runs a speculative step
only when every row can take part (no grammar yet; greedy, sampled and seeded rows are all
exact, engine/speculation/verify.py; logprobs are the target's at each emitted position, and an
`ignore_eos` row's end ids are masked at every position as its plain step masks them) and
every layer's cache is plain KV
(`KVCache` solo, `BatchKVCache` merged), whose rows roll back exactly. Else, or when no row's
controller wants a draft, or no row has one, the plain step runs. A request that opted out
(`SamplingParams.speculative` False) drafts nothing: it takes part in a verify pass with its
one token, so its company still speculates.

One speculative step (docs/speculation.md, "Where drafting, verify and rollback go"):
1. each row's depth from its controller; if any is positive and some such row's lookup has a
   match for its tokens so far, every row's pending token is read (speculating rows give up the
   pipelining overlap: the drafter needs that token);
2. each row's draft (its `PromptLookup`, synced with its tokens), cut to the batch's width;
3. one pass of W tokens per row (its token, its draft, padding), logits at every position;
4. `verify`, one readback; each row takes its emitted tokens (`Sequence.take_run`);
5. each row's rejected positions rolled back: `trim` solo; merged, a uniform `trim` of what all
   rows reject and holes for the rest (engine/speculation/holes.py).
Steps are timed whole (plain ones too), so `VerifyCost` compares what a round really costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_kvserve.engine.sequence import Sequence
from mlx_kvserve.engine.speculation.depth import DepthController, VerifyCost, plan_width
from mlx_kvserve.engine.speculation.drafts import PromptLookup
from mlx_kvserve.engine.speculation.holes import HoleKVCache
from mlx_kvserve.engine.speculation.verify import verify


@dataclass
class RowState:
    """A row's drafter and depth controller, made when it first takes part."""

    lookup: PromptLookup = field(default_factory=PromptLookup)
    depth: DepthController = field(default_factory=DepthController)


class Speculator:
    """Speculative steps for one decode batch, and what they drafted and kept."""

    def __init__(self, max_depth: int = 8) -> None:
        self.max_depth = max_depth
        self.cost = VerifyCost()
        self.rows: dict[int, RowState] = {}  # id(sequence) -> its state, while it decodes
        self.passes = self.drafted = self.accepted = 0

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Rows without a grammar (it would need a mask per drafted position); greedy, sampled
        and seeded alike (verify.py keeps each exact), logprobs and `ignore_eos` too."""
        return seq.decoder.constraint is None

    def observe(self, batch: int, width: int, seconds: float) -> None:
        self.cost.observe(batch, width, seconds)

    def forget(self, seqs: list[Sequence]) -> None:
        """Drop the state of rows that left the batch."""
        live = {id(s) for s in seqs}
        for key in [k for k in self.rows if k not in live]:
            del self.rows[key]

    def step(
        self,
        seqs: list[Sequence],
        merged: list | None,
        model: nn.Module,
        read: Callable[[list], None],
        leave: Callable[[], None],
    ) -> int:
        """Run one speculative step if it pays: the pass's width; 0 if nothing ran, -1 if the
        rows' pending tokens were read but no draft paid (either way the caller runs the plain
        step). `read` and `leave` are the batch's own readback and departures."""
        if not seqs or not all(self.eligible(s) for s in seqs):
            return 0
        caches = merged if merged is not None else seqs[0].live.caches
        kinds = (KVCache,) if merged is None else (BatchKVCache, HoleKVCache)
        if not all(type(c) in kinds for c in caches):
            return 0
        batch = len(seqs)
        states = [self.rows.setdefault(id(s), RowState()) for s in seqs]

        def cost(width: int) -> float:
            return self.cost.cost(batch, width)

        depths = [
            state.depth.depth(cost, self.max_depth) if seq.req.params.speculative else 0
            for seq, state in zip(seqs, states, strict=True)
        ]  # a row that opted out feeds one token in the verify pass, as in a plain step
        if not any(depths):
            return 0
        for seq, state in zip(seqs, states, strict=True):
            sync(seq, state.lookup)
        # A pipelined row's pending token is still on the device: reading it gives up the
        # overlap, so that is done only if some row that wants a draft would have had one a
        # token ago (prose seldom does; a file being copied does).
        if any(seq.step is not None for seq in seqs) and not any(
            depth and state.lookup.propose(1) for state, depth in zip(states, depths, strict=True)
        ):
            return 0
        read([(seq, seq.step) for seq in seqs])  # the drafts follow each row's pending token
        leave()
        if any(seq.done for seq in seqs):
            return -1  # a row ended on its pending token (and left): the plain step serves the rest
        drafts = []
        for seq, state, depth in zip(seqs, states, depths, strict=True):
            assert seq.step is None and len(seq.feed) == 1
            sync(seq, state.lookup)
            room = seq.limit - seq.timings.completion_tokens - 1
            draft = state.lookup.propose(min(depth, room))
            drafts.append(list(draft.tokens) if draft else [])
        if not any(drafts):
            return -1
        curves = [s.depth.expected(len(d)) for s, d in zip(states, drafts, strict=True)]
        width = plan_width(curves, cost, margin=0.0)
        if width == 1:
            return -1
        drafts = [d[: width - 1] for d in drafts]
        accepted = self._verify(seqs, merged, model, drafts, width)
        for seq, state, draft, kept in zip(seqs, states, drafts, accepted, strict=True):
            state.depth.record(len(draft), kept)
            seq.timings.drafted += len(draft)
            seq.timings.accepted += kept
            seq.timings.verify_passes += bool(draft)
            self.drafted += len(draft)
            self.accepted += kept
        self.passes += 1
        return width

    def _verify(
        self,
        seqs: list[Sequence],
        merged: list | None,
        model: nn.Module,
        drafts: list[list[int]],
        width: int,
    ) -> list[int]:
        """Feed, verify, take and roll back; the drafts each row kept."""
        rows = []
        for seq, draft in zip(seqs, drafts, strict=True):
            (token,) = seq.feed
            rows.append([token, *draft] + [token] * (width - 1 - len(draft)))
            seq.live.tokens.append(token)
            seq.feed = []
        tokens = mx.array(rows, dtype=mx.uint32)
        caches = merged if merged is not None else seqs[0].live.caches
        logits = model(tokens, cache=caches)
        vocab = min((s.decoder.vocab for s in seqs if s.decoder.vocab is not None), default=None)
        masks = row_masks(seqs, vocab or logits.shape[-1], width)
        verified = verify([s.decoder for s in seqs], logits, drafts, vocab=vocab, masks=masks)
        emitted = verified.read()
        rejected = []
        for i, (seq, out) in enumerate(zip(seqs, emitted, strict=True)):
            if seq.decoder.seeded:  # position j was drawn as its token number draws + j
                seq.decoder.draws += len(out)
            rejected.append(width - seq.take_run(out, logits[i], verified.logprobs[i]))
        roll_back(caches, rejected)
        return [len(out) - 1 for out in emitted]


def row_masks(seqs: list[Sequence], vocab: int, width: int) -> mx.array | None:
    """(B, W, vocab) the tokens each row may take at every position of the pass, or None when
    no row masks any: an `ignore_eos` row's mask (every id but the end ones) is the same at
    every position, so it is its plain step's mask repeated."""
    masks = [seq.decoder.mask(vocab, False) for seq in seqs]
    if all(m is None for m in masks):
        return None
    every = mx.ones((vocab,), dtype=mx.bool_)
    rows = mx.stack([every if m is None else m for m in masks])
    return mx.broadcast_to(rows[:, None, :], (len(seqs), width, vocab))


def sync(seq: Sequence, lookup: PromptLookup) -> None:
    """Bring a row's lookup up to its tokens: those in its caches, then those to feed."""
    tokens = seq.live.tokens
    if len(lookup) < len(tokens):
        lookup.extend(tokens[len(lookup) :])
    if seq.feed and len(lookup) < len(tokens) + len(seq.feed):
        lookup.extend(seq.feed[len(lookup) - len(tokens) :])


def roll_back(caches: list, rejected: list[int]) -> None:
    """Give back each row's `rejected[i]` newest positions: `trim` for a `KVCache` (one row);
    a merged batch's caches become `HoleKVCache`s, whose rows give back their own slots
    without moving KV (engine/speculation/holes.py)."""
    for c in caches:
        if isinstance(c, BatchKVCache):
            HoleKVCache.adopt(c).rollback(rejected)
        else:
            (r,) = rejected
            c.trim(r)
