"""A decode step that drafts and verifies: prompt lookup, the prompt cache's continuations, MTP.

`DecodeBatch.step` (engine/batch.py) asks `Speculator.step` first; it runs a speculative step
only when every row can take part (`eligible`: greedy, sampled and seeded rows are all exact,
engine/speculation/verify.py; logprobs are the target's at each emitted position; an
`ignore_eos` row's end ids are masked at every position as its plain step masks them; a grammar
row's draft is walked through a copy of its matcher, engine/decode.py `Decoder.walk`, and fed
with the tokens the grammar forces, engine/speculation/plan.py) and every layer's cache rolls back
exactly: plain KV (`KVCache` solo, `BatchKVCache` merged, trimmed or holed) and windows (cut
or rolled: engine/speculation/rewind.py), or a recurrent state (engine/speculation/snapshot.py:
snapshot, then replay of each row's kept prefix; merged only on a model whose layers honour
the rows' lengths, asked once).
Else, or when no row's controller wants a draft, or no row has one, the plain step runs. A
request that opted out (`SamplingParams.speculative` False) drafts nothing: it takes part in a
verify pass with its one token, so its company still speculates.

One speculative step (docs/speculation.md, "Where drafting, verify and rollback go"):
1. each row's depth from its controller (its rates starting from what its draft source kept
   before on this engine, `SourcePriors`; a read that may find no draft weighed); if any is
   positive and some such row's lookup has a match for its tokens so far, every row's pending
   token is read (speculating rows give up the pipelining overlap: the drafter needs it);
2. each row's draft (its `Drafter`: `PromptLookup` and, given `continuations`, the prompt
   cache's continuations of its namespace, and, given `mtp`, the checkpoint's MTP heads fed
   the target's hidden states of every pass (mtp.py), synced with its tokens; a grammar row's
   checked token by token, a refused token ending it, forced tokens following each drafted
   one), cut to the batch's width;
3. one pass of W tokens per row (its pending tokens, its draft, padding), logits at each row's
   sample slots;
4. `verify`, one readback; each row takes its emitted tokens (`Sequence.take_run`);
5. each row's rejected positions rolled back: `trim` solo; merged, a uniform `trim` of what
   all rows reject and holes for the rest (engine/speculation/holes.py); windows cut (solo) or
   each row's rejected keys rolled into its padding (merged); recurrent states by snapshot and
   replay, the replay in the step's time.
Steps are timed whole (plain ones too, and plain ones after a read-first that drafted nothing,
as `READ_FIRST`), so `VerifyCost` compares what each kind of round really costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.engine.positions import shifted
from mlx_kvserve.engine.sequence import Sequence
from mlx_kvserve.engine.speculation.continuations import CacheLookup, Continuations
from mlx_kvserve.engine.speculation.depth import (
    READ_FIRST,
    DepthController,
    SourcePriors,
    VerifyCost,
    plan_width,
)
from mlx_kvserve.engine.speculation.draft_model import NAME as DRAFT_MODEL
from mlx_kvserve.engine.speculation.draft_model import DraftModel, DraftModelRow
from mlx_kvserve.engine.speculation.drafts import Drafter, DraftSource, PromptLookup
from mlx_kvserve.engine.speculation.mtp import MTPDraft, Tap
from mlx_kvserve.engine.speculation.plan import Plan, row_masks, slot_logits
from mlx_kvserve.engine.speculation.rewind import roll_back
from mlx_kvserve.engine.speculation.snapshot import (
    Snapshot,
    needs_snapshot,
    replay,
    replay_agrees,
    restorable,
)
from mlx_kvserve.engine.speculation.verify import verify
from mlx_kvserve.models.mtp_heads import MTPHeads


@dataclass
class RowState:
    """A row's drafter (its own tokens, then its namespace's prompt-cache continuations) and
    depth controller, made when it first takes part."""

    drafter: Drafter
    depth: DepthController = field(default_factory=DepthController)
    model_row: DraftModelRow | None = None  # its row of the draft model's batch, if any
    mtp: MTPDraft | None = None  # its MTP source, fed the target's hidden states


class Speculator:
    """Speculative steps for one decode batch, and what they drafted and kept."""

    def __init__(
        self,
        max_depth: int = 16,
        continuations: Continuations | None = None,
        mtp: MTPHeads | None = None,
        draft_model: DraftModel | None = None,
        short_depth: int = 8,
        cost: VerifyCost | None = None,
    ) -> None:
        """`continuations`: finished requests' tokens by namespace, a second draft source;
        `mtp`: the checkpoint's MTP heads, a third (the batch's model is then their `Tap`);
        `draft_model`: a small model of the same tokenizer, a fourth (draft_model.py).
        `max_depth`: the most a lone row drafts from copies (free: a source that keeps
        matching is followed that far, as its controller finds it pays); `short_depth`: the
        most a merged row drafts (a wide pass of many rows is bound by compute), and a row
        with a source that costs a forward per draft; `cost`: the verify cost to weigh
        depths with (in a job, rank 0's: job.py)."""
        self.max_depth, self.short_depth = max_depth, short_depth
        self.continuations = continuations
        self.mtp = mtp
        self.draft_model = draft_model
        self.cost = cost if cost is not None else VerifyCost()
        self.priors = SourcePriors(max_depth)  # what each source's drafts kept, shared by rows
        self.read_first = False  # the last step read its rows' pending tokens to draft
        self.rows: dict[int, RowState] = {}  # id(sequence) -> its state, while it decodes
        self.passes = self.drafted = self.accepted = 0
        self.replays: bool | None = None  # merged window/recurrent rows replay exactly

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Greedy, sampled and seeded rows alike (verify.py keeps each exact), logprobs and
        `ignore_eos` too; a grammar row if its constraint can copy itself for the draft's walk
        (llguidance's matcher, the reasoning gate, Harmony's analysis gate). A seeded grammar
        row's slots draw the seeds of its sampled tokens in order, and its forced tokens none,
        as without it."""
        return seq.decoder.walkable

    def observe(self, batch: int, width: int, seconds: float) -> None:
        """A step of `batch` rows took `seconds`: a plain one (width 1), a verify pass, or
        (width -1) a plain one after its rows' pending tokens were read first to draft (timed
        as `READ_FIRST`, what such a miss costs); a step that read nothing to draft, none."""
        if width < 0:
            if not self.read_first:
                return
            width = READ_FIRST
        if self.draft_model is not None:  # its passes are weighed apart (draft_model.py)
            seconds -= self.draft_model.take_seconds()
        self.cost.observe(batch, width, seconds)

    def forget(self, seqs: list[Sequence]) -> None:
        """Drop the state of rows that left the batch."""
        live = {id(s) for s in seqs}
        for key in [k for k in self.rows if k not in live]:
            del self.rows[key]
        if self.draft_model is not None:
            self.draft_model.forget([s.model_row for s in self.rows.values() if s.model_row])

    def step(
        self,
        seqs: list[Sequence],
        merged: list | None,
        model: nn.Module | Tap,
        read: Callable[[list], None],
        leave: Callable[[], None],
    ) -> int:
        """Run one speculative step if it pays: the pass's width; 0 if nothing ran, -1 if the
        rows' pending tokens were read but no draft paid (either way the caller runs the plain
        step). `read` and `leave` are the batch's own readback and departures."""
        self.read_first = False
        if not seqs or not all(self.eligible(s) for s in seqs):
            return 0
        caches = merged if merged is not None else seqs[0].live.caches
        if not all(restorable(c) for c in caches):
            return 0
        if merged is not None and needs_snapshot(caches) and not self._replays(model):
            return 0
        batch = len(seqs)
        if self.cost.untimed(batch):  # the plain step that runs instead is timed
            return 0
        states = [self._state(s) for s in seqs]

        def cost(width: int) -> float:
            return self.cost.cost(batch, width)

        # rows whose draft would be the draft model's: its passes are part of their cost
        uses = self._uses_draft_model(seqs, states)
        drafting = cost if self.draft_model is None else self.draft_model.cost(self.cost, batch)
        pipelined = any(seq.step is not None for seq in seqs)
        miss = self.cost.read_first(batch)
        peeks, depths = [], []
        for seq, state, use in zip(seqs, states, uses, strict=True):
            sync(seq, state.drafter)
            # the source its draft would come from a token ago, and what that source was worth
            peek = state.drafter.peek() if seq.req.params.speculative else None
            peeks.append(peek)
            if not seq.req.params.speculative:  # it feeds one token in the verify pass
                depths.append(0)
                continue
            hit = state.depth.hit_rate(self.priors.hit_rate(peek)) if pipelined else 1.0
            prior = None if peek is None else self.priors.rates(peek)
            price = drafting if use else cost
            cap = self._cap(state, batch)
            depths.append(state.depth.depth(price, cap, prior=prior, hit=hit, miss=miss))
        if not any(depths):
            return 0
        # A pipelined row's pending token is still on the device: reading it gives up the
        # overlap, so that is done only if some row that wants a draft would have had one a
        # token ago (prose seldom does; a file being copied does; the draft model always has).
        wanting = [
            bool(depth and (use or peek is not None))
            for depth, use, peek in zip(depths, uses, peeks, strict=True)
        ]
        if pipelined and not any(wanting):
            return 0
        read([(seq, seq.step) for seq in seqs])  # the drafts follow each row's pending token
        self.read_first = pipelined
        leave()
        if any(seq.done for seq in seqs):
            return -1  # a row ended on its pending token (and left): the plain step serves the rest
        vocab = min(s.decoder.vocab or s.last_logits.shape[-1] for s in seqs)
        if self.draft_model is not None:  # every row that wants a draft, in one batch
            for seq, state in zip(seqs, states, strict=True):
                sync(seq, state.drafter)
            wanted = [
                (s.model_row, d if use else 0)
                for s, d, use in zip(states, depths, uses, strict=True)
                if s.model_row
            ]
            self.draft_model.draft(wanted, vocab)
        plans: list[Plan] = []
        sources: list[tuple[str, int] | None] = []  # each row's draft's source and evidence
        for seq, state, depth in zip(seqs, states, depths, strict=True):
            assert seq.step is None and seq.feed
            sync(seq, state.drafter)
            left = seq.limit - seq.timings.completion_tokens
            if seq.decoder.constraint is None:
                draft = state.drafter.propose(min(depth, left - 1), self._worth(state))
                plans.append(Plan(list(seq.feed), list(draft.tokens) if draft else []))
                sources.append((draft.source, draft.evidence) if draft else None)
                continue
            # the proposal runs through what the grammar forces, which costs no draft
            limit = min(2 * self._cap(state, len(seqs)), left - 1)
            draft = state.drafter.propose(limit, self._worth(state)) if depth else None
            proposal = list(draft.tokens) if draft else []
            walk = seq.decoder.walk(proposal, vocab, depth, left, seq.eos)
            plans.append(Plan(list(seq.feed), walk.drafts, walk.forced, walk.masks))
            sources.append((draft.source, draft.evidence) if draft else None)
        curves = [s.depth.expected(len(p.drafts)) for s, p in zip(states, plans, strict=True)]
        # drafts made are paid for: verify only
        planned = plan_width(curves, cost, margin=0.0) if any(p.drafts for p in plans) else 1
        if self.read_first:  # each row that read first to draft: did it get to?
            for state, peek, want, plan in zip(states, peeks, wanting, plans, strict=True):
                if want:
                    state.depth.read(planned > 1 and bool(plan.drafts))
                    self.priors.read(peek, planned > 1 and bool(plan.drafts))
        if planned == 1:
            return -1
        plans = [plan.cut(planned) for plan in plans]
        accepted, width = self._verify(seqs, merged, model, plans, vocab)
        for seq, state, plan, kept, source in zip(
            seqs, states, plans, accepted, sources, strict=True
        ):
            state.depth.record(len(plan.drafts), kept, source)
            if plan.drafts:
                self.priors.record(source, len(plan.drafts), kept)
            seq.timings.drafted += len(plan.drafts)
            seq.timings.accepted += kept
            seq.timings.verify_passes += bool(plan.drafts)
            if plan.drafts and source is not None:
                counts = seq.timings.by_source.setdefault(source[0], [0, 0, 0])
                counts[0] += len(plan.drafts)
                counts[1] += kept
                counts[2] += 1
                if source[0] == DRAFT_MODEL and self.draft_model is not None:
                    self.draft_model.record(len(plan.drafts), kept)
            self.drafted += len(plan.drafts)
            self.accepted += kept
        self.passes += 1
        return width

    def _worth(self, state: RowState) -> Callable[[str, int], float]:
        """What a source's first drafts of a match length were worth, for choosing between
        equal matches: the row's own rounds over the engine's (`SourcePriors`)."""

        def worth(source: str, evidence: int) -> float:
            return state.depth.worth((source, evidence), self.priors.worth(source, evidence))

        return worth

    def _cap(self, state: RowState, batch: int) -> int:
        """The deepest draft of a row: a model's drafts cost a forward each, copies none; a
        merged batch's wide pass is bound by compute (8 agents lost a third at 16)."""
        costed = state.mtp is not None or state.model_row is not None
        return self.short_depth if costed or batch > 1 else self.max_depth

    def _replays(self, model: nn.Module) -> bool:
        """Whether this model's merged rows replay exactly (asked once: snapshot.py)."""
        if self.replays is None:
            self.replays = replay_agrees(model)
        return self.replays

    def _uses_draft_model(self, seqs: list[Sequence], states: list[RowState]) -> list[bool]:
        """Per row: would its draft come from the draft model (no free source's guess as good)?"""
        if self.draft_model is None:
            return [False] * len(seqs)
        out = []
        for seq, state in zip(seqs, states, strict=True):
            sync(seq, state.drafter)
            out.append(state.model_row is not None and self.draft_model.wanted(state.drafter))
        return out

    def _state(self, seq: Sequence) -> RowState:
        state = self.rows.get(id(seq))
        if state is None:
            sources: list[DraftSource] = [PromptLookup()]
            if self.continuations is not None:
                sources.append(CacheLookup(self.continuations.index(seq.req.namespace)))
            mtp = None
            if self.mtp is not None:  # its prefill's own, fed the whole prompt, if it made one
                own_mtp = seq.live.mtp
                mtp = MTPDraft(self.mtp) if own_mtp is None else own_mtp.adopted()
            row = self.draft_model.row() if self.draft_model is not None else None
            own = [s for s in (mtp, row) if s is not None]
            depth = DepthController(self.max_depth)
            state = RowState(Drafter(sources + own), depth, mtp=mtp, model_row=row)
            self.rows[id(seq)] = state
        return state

    def joined(self, seq: Sequence, model: object) -> None:
        """A row joins: its MTP source is the one its prefill fed chunk by chunk; a row whose
        prefill made none (its model was not the tap) takes the hidden states of its
        prefill's last pass, if that pass ran on its own caches (the prompt's tail)."""
        if self.mtp is None or not seq.req.params.speculative:
            return
        if seq.live.mtp is not None:
            state = self.rows.get(id(seq))
            if state is not None and state.mtp is not seq.live.mtp:
                del self.rows[id(seq)]  # from before a pause: its prefill fed a new source
            sync(seq, self._state(seq).drafter)
            return
        if not isinstance(model, Tap) or model.hidden is None:
            return
        if model.cache is not seq.live.caches:
            return  # another row's pass (a prompt the cache served whole, a fork, a resume)
        state = self._state(seq)
        assert state.mtp is not None
        sync(seq, state.drafter)
        width = model.hidden.shape[1]
        state.mtp.record(len(seq.live.tokens) - width, model.hidden[0])

    def passed(self, seqs: list[Sequence], model: object) -> None:
        """After a plain pass: each row's MTP source takes the hidden states of what it fed
        (the positions before its cache's end; a pipelined row's fed token is still unread)."""
        if self.mtp is None or not isinstance(model, Tap) or model.hidden is None:
            return
        width = model.hidden.shape[1]
        for i, seq in enumerate(seqs):
            if not seq.req.params.speculative:
                continue  # it drafts nothing: its MTP source would only cost
            state = self._state(seq)
            assert state.mtp is not None
            sync(seq, state.drafter)  # its pairs need their next tokens, steps it drafts or not
            end = len(seq.live.tokens) + (seq.unread is not None)
            state.mtp.record(end - width, model.hidden[i])

    def _verify(
        self,
        seqs: list[Sequence],
        merged: list | None,
        model: nn.Module | Tap,
        plans: list[Plan],
        vocab: int,
    ) -> tuple[list[int], int]:
        """Feed, verify, take and roll back; the drafts each row kept, and the pass's width."""
        rows = [plan.inputs() for plan in plans]
        width = max(len(row) for row in rows)
        for seq, row in zip(seqs, rows, strict=True):
            row += [row[0]] * (width - len(row))  # padding: rejected whatever it holds
            seq.live.tokens.extend(seq.feed)
            seq.feed = []
        caches = merged if merged is not None else seqs[0].live.caches
        snapshot = Snapshot(caches) if needs_snapshot(caches) else None
        with shifted(model, seqs):  # rows past an image under M-RoPE (engine/positions.py)
            logits = model(mx.array(rows, dtype=mx.uint32), cache=caches)
        hidden = model.hidden if isinstance(model, Tap) else None
        slots = max(len(plan.drafts) for plan in plans) + 1
        logits = slot_logits(logits, plans, slots)
        masks = row_masks(seqs, plans, vocab, slots)
        drafts = [plan.drafts for plan in plans]
        verified = verify([s.decoder for s in seqs], logits, drafts, vocab=vocab, masks=masks)
        emitted = verified.read()
        rejected = []
        for i, (seq, plan, out) in enumerate(zip(seqs, plans, emitted, strict=True)):
            if seq.decoder.seeded:  # slot j was drawn as its token number draws + j
                seq.decoder.draws += len(out)
            start = len(seq.live.tokens) - len(plan.feed)  # the pass's first position
            kept = seq.take_run(out, logits[i], verified.logprobs[i], fed=len(plan.feed))
            rejected.append(width - kept)
            mtp = self.rows[id(seq)].mtp
            if hidden is not None and mtp is not None and seq.req.params.speculative:
                mtp.record(start, hidden[i, :kept])  # only what stays: never a rejected one
        if snapshot is not None and any(rejected):  # back to before the pass, then replay
            snapshot.restore()
            kept_rows = [row[: width - r] for row, r in zip(rows, rejected, strict=True)]
            with shifted(model, seqs):
                replay(model, caches, kept_rows)
        elif snapshot is None:
            roll_back(caches, rejected)
        return [len(out) - 1 for out in emitted], width


def sync(seq: Sequence, drafter: Drafter) -> None:
    """Bring a row's drafter up to its tokens: those in its caches, then those to feed."""
    tokens = seq.live.tokens
    if len(drafter) < len(tokens):
        drafter.extend(tokens[len(drafter) :])
    if seq.feed and len(drafter) < len(tokens) + len(seq.feed):
        drafter.extend(seq.feed[len(drafter) - len(tokens) :])
