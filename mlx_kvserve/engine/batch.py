"""The running decode batch: one forward pass per step for every sequence in it. ENGINE THREAD.

Decode is memory-bound: a pass reads every weight once whether it computes one row or eight, so
sequences that decode together share that cost. Sequences join between steps (after their own
prefill, which runs alone through the prompt cache exactly as before) and leave when they end.

Two modes, chosen by size:
- **solo** (one sequence): the pass runs on that sequence's own mlx-lm caches, exactly the loop
  of a lone request, so batching costs a lone request nothing. A constrained sequence feeds a
  sampled token and the tokens its grammar forces in one pass.
- **merged** (two or more): the sequences' caches are merged layer by layer with the layer
  class's own `merge`, as `mlx_lm.generate.BatchGenerator` does (`_merge_caches`): `KVCache`
  into `BatchKVCache` (left-padded rows, its own attention mask and per-row RoPE offsets),
  `RotatingKVCache` into `BatchRotatingKVCache`, `ArraysCache` (SSM state) into one array per
  state with a row per sequence, `CacheList` part by part. Each row feeds exactly one token per
  pass. A sequence that leaves is cut out with `extract` (its own per-layer caches again, for
  its checkpoint and as a resident session) and the rest are kept with `filter`; when one is
  left it goes back to solo mode.

Every step samples all rows in one call and reads their tokens back in one readback, as
mlx-lm's `BatchGenerator` does (engine/sampling.py); `readbacks` and `steps` count them.

Layers whose class cannot merge (`QuantizedKVCache`, `ChunkedKVCache`, classes mlx-lm does not
define), or an architecture whose merged step answers otherwise than its solo one (Gemma 2,
GPT-BigCode; engine/merge_check.py asks each model at load), make the model decode one sequence
at a time (`can_batch` is False), which is always correct. The queue keeps moving meanwhile:
the others are prefilled beside it as usual (their own caches, the scheduler's chunks), and
wait here (`waiting`), first token sampled, until the running one leaves. See cache/kinds.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from mlx_kvserve.cache.kinds import KVLayout, LayerCache
from mlx_kvserve.engine import sampling
from mlx_kvserve.engine.positions import shifted
from mlx_kvserve.engine.requests import GenerationRequest
from mlx_kvserve.engine.sampling import Step
from mlx_kvserve.engine.sequence import Sequence
from mlx_kvserve.engine.speculation.continuations import Continuations
from mlx_kvserve.engine.speculation.draft_model import DraftModel
from mlx_kvserve.engine.speculation.job import AgreedCost, CheckedPasses, Decide
from mlx_kvserve.engine.speculation.mtp import Tap
from mlx_kvserve.engine.speculation.step import Speculator
from mlx_kvserve.models.mtp_heads import MTPHeads

log = logging.getLogger("mlx_kvserve.engine")


def can_batch(layout: KVLayout) -> bool:
    """Whether rows of this model decode together: every layer's class can `merge`."""
    return layout.mergeable


def _merge(caches: list[LayerCache]) -> LayerCache:
    """One layer's caches (a row each) as the batch cache of that layer's class (e.g. a
    `BatchKVCache`, which also has `extend`, `extract` and `filter`)."""
    return type(caches[0]).merge(caches)


class DecodeBatch:
    """The sequences decoding now, and the caches their next pass runs on."""

    def __init__(
        self,
        model: nn.Module,
        on_end: Callable[[Sequence], None],
        *,
        mergeable: bool = True,
        speculation: str = "off",
        continuations: Continuations | None = None,
        mtp: MTPHeads | None = None,
        draft_model: DraftModel | None = None,
        job: Callable[[list[int]], None] | None = None,
    ) -> None:
        """`speculation` "auto": rows draft and verify when it pays (engine/speculation/step.py),
        from their own tokens, `continuations` (finished requests' tokens), the model's
        `mtp` heads (passes then go through their `Tap`, which keeps the hidden states) and a
        `draft_model`; "off": never. `job`: the batch steps with other ranks, which must
        speculate alike (engine/speculation/job.py: `agree` before each step), and is the check
        of each pass's shape across them."""
        self.model: nn.Module | Tap | CheckedPasses = model
        self.on_end = on_end  # called once per sequence that ended, after it left the batch
        self.mergeable = mergeable  # False: one sequence decodes, the others wait their turn
        self.seqs: list[Sequence] = []
        self.waiting: list[Sequence] = []  # prefilled, for a model that decodes one at a time
        self._merged: list[LayerCache] | None = None  # merged mode's caches, row i = seqs[i]
        self.steps = 0  # decode steps run
        self.readbacks = 0  # device-to-host reads of sampled tokens (one per step, mostly)
        self.speculator = None
        if speculation == "auto":
            self.speculator = Speculator(
                continuations=continuations,
                mtp=mtp,
                draft_model=draft_model,
                cost=AgreedCost() if job is not None else None,
            )
            if job is not None:  # whether merged rows replay exactly would be each rank's own check
                self.speculator.replays = False
                self.model = CheckedPasses(self.model, job)
            if mtp is not None and not isinstance(model, Tap):
                self.model = Tap(model, mtp)

    def __len__(self) -> int:
        return len(self.seqs) + len(self.waiting)

    @property
    def requests(self) -> list[GenerationRequest]:
        return [seq.req for seq in self.seqs + self.waiting]

    def kv_tokens(self) -> int:
        """Tokens the sequences hold in KV, plus what they may still generate."""
        return sum(
            len(s.live.tokens) + s.limit - s.timings.completion_tokens
            for s in self.seqs + self.waiting
        )

    def add(self, seq: Sequence) -> None:
        """Join between steps; the sequence's caches hold exactly its `live.tokens`."""
        if self.speculator is not None:
            self.speculator.joined(seq, self.model)  # its prefill's hidden states, for MTP
        if not self.seqs:
            self.seqs.append(seq)
            return
        if not self.mergeable:
            self.waiting.append(seq)
            return
        if self._merged is None:
            solo = self.seqs[0]
            self._merged = [
                _merge([a, b]) for a, b in zip(solo.live.caches, seq.live.caches, strict=True)
            ]
            solo.live.caches = []  # merged: the solo copy would stay alive beside its row
        else:
            for batch_cache, cache in zip(self._merged, seq.live.caches, strict=True):
                batch_cache.extend(_merge([cache]))
        seq.live.caches = []
        self.seqs.append(seq)

    def take(self, seq: Sequence) -> None:
        """Take a running sequence out between steps (to pause it): it gets its own caches back,
        holding exactly its `live.tokens`; it is not reported as ended."""
        assert not any(s.done for s in self.seqs)  # between steps, none has ended
        seq.finish = "paused"
        try:
            self._leave(report=False)
        finally:
            seq.finish = None

    def step(self) -> None:
        """One decode step for every sequence: cancellations, one pass, one readback,
        departures."""
        for seq in self.seqs + self.waiting:
            if seq.req.cancelled.is_set():
                seq.cancel()
        self._read([(seq, seq.first_read()) for seq in self.seqs])  # newcomers, redraws
        self._leave()
        if not self.seqs:
            if self.speculator is not None:  # the rows that left drop their draft state (KV)
                self.speculator.forget([])
            return
        self.steps += 1
        for seq in self.seqs:
            seq.timings.batch_peak = max(seq.timings.batch_peak, len(self.seqs))
        rows, started, width = len(self.seqs), time.perf_counter(), 0
        if self.speculator is not None:
            width = self.speculator.step(
                self.seqs, self._merged, self.model, self._read, self._leave
            )
            self.readbacks += width > 0  # the verify pass's
        if width <= 0 and self.seqs:
            if any(seq.wants_forward() for seq in self.seqs):
                self._forward()
                self._read([(seq, seq.to_read()) for seq in self.seqs])
            else:
                self._read([(seq, seq.step) for seq in self.seqs])
        self._leave()
        if self.speculator is not None:
            # a plain step (0), a verify pass, or a plain one after reading first (-1): what
            # each kind of round costs
            self.speculator.observe(rows, width or 1, time.perf_counter() - started)
            self.speculator.forget(self.seqs)

    def agree(self, decide: Decide) -> None:
        """In a job, before a step: every rank weighs drafts with rank 0's timings (job.py)."""
        if self.speculator is not None and isinstance(self.speculator.cost, AgreedCost):
            self.speculator.cost.agree(decide)

    def speculated(self) -> dict[str, list[int]]:
        """Each row's drafted and accepted tokens so far, for a job's digest (request id: ...)."""
        return {
            seq.req.request_id: [seq.timings.drafted, seq.timings.accepted]
            for seq in self.seqs + self.waiting
        }

    def fail_all(self) -> list[Sequence]:
        """After a failed pass: the batch's state is unknown, so every sequence leaves."""
        failed, self.seqs, self.waiting, self._merged = self.seqs + self.waiting, [], [], None
        return failed

    # ------------------------------------------------------------------------------------
    def _forward(self) -> None:
        """One pass for every row, then one sampling call for the rows that sample."""
        with shifted(self.model, self.seqs):  # rows past an image under M-RoPE
            if self._merged is None:
                (seq,) = self.seqs
                tokens = seq.inputs(one=False)[None]
                logits = self.model(tokens, cache=seq.live.caches)[:, -1, :]
            else:
                tokens = mx.concatenate([seq.inputs(one=True) for seq in self.seqs])[:, None]
                logits = self.model(tokens, cache=self._merged)[:, -1, :]
        if self.speculator is not None:
            self.speculator.passed(self.seqs, self.model)  # MTP heads' hidden states
        rows = [i for i, seq in enumerate(self.seqs) if seq.wants_sample()]
        for i, seq in enumerate(self.seqs):
            seq.last_logits = logits if len(self.seqs) == 1 else logits[i : i + 1]
        if not rows:
            return
        some = logits if len(rows) == len(self.seqs) else logits[mx.array(rows)]
        steps = sampling.sample([self.seqs[i].sample_row() for i in rows], some)
        for i, step in zip(rows, steps, strict=True):
            self.seqs[i].step = step

    def _read(self, wanted: list[tuple[Sequence, Step | None]]) -> None:
        """Read the given steps back in one go and hand each sequence its token."""
        pairs = [(seq, step) for seq, step in wanted if step is not None]
        if not pairs:
            return
        self.readbacks += 1
        tokens = sampling.read([step for _, step in pairs])
        for (seq, step), token in zip(pairs, tokens, strict=True):
            seq.take(step, token)

    def _leave(self, *, report: bool = True) -> None:
        """Cut the sequences that ended out of the batch, then report them; a waiting
        sequence (one-at-a-time models) takes the place of the one that left."""
        gone = [seq for seq in self.waiting if seq.done]
        self.waiting = [seq for seq in self.waiting if not seq.done]
        ended = [i for i, seq in enumerate(self.seqs) if seq.done]
        gone += [self.seqs[i] for i in ended]
        if self._merged is not None and ended:
            for i in ended:
                self.seqs[i].live.caches = [c.extract(i) for c in self._merged]
            keep = [i for i in range(len(self.seqs)) if i not in ended]
            if len(keep) == 1:
                (last,) = keep
                self.seqs[last].live.caches = [c.extract(last) for c in self._merged]
                self._merged = None
            elif keep:
                for c in self._merged:
                    c.filter(keep)
            else:
                self._merged = None
        self.seqs = [seq for seq in self.seqs if not seq.done]
        if not self.seqs and self.waiting:
            self.seqs.append(self.waiting.pop(0))
        for seq in gone if report else ():
            self.on_end(seq)
