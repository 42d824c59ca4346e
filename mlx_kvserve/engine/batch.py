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

Layers whose class cannot merge (`QuantizedKVCache`, `ChunkedKVCache`, classes mlx-lm does not
define) make the model run one sequence at a time (`can_batch` is False), which is always
correct. See cache/kinds.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_kvserve.cache.kinds import KVLayout
from mlx_kvserve.engine.sequence import Sequence

log = logging.getLogger("mlx_kvserve.engine")


def can_batch(layout: KVLayout) -> bool:
    """Whether rows of this model decode together: every layer's class can `merge`."""
    return layout.mergeable


def _merge(caches: list) -> Any:
    """One layer's caches (a row each) as the batch cache of that layer's class."""
    return type(caches[0]).merge(caches)


class DecodeBatch:
    """The sequences decoding now, and the caches their next pass runs on."""

    def __init__(self, model: Any, on_end: Callable[[Sequence], None]) -> None:
        self.model = model
        self.on_end = on_end  # called once per sequence that ended, after it left the batch
        self.seqs: list[Sequence] = []
        self._merged: list[Any] | None = None  # merged mode's caches, row i = seqs[i]

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def requests(self) -> list[Any]:
        return [seq.req for seq in self.seqs]

    def kv_tokens(self) -> int:
        """Tokens the running sequences hold in KV, plus what they may still generate."""
        return sum(len(s.live.tokens) + s.limit - s.timings.completion_tokens for s in self.seqs)

    def add(self, seq: Sequence) -> None:
        """Join between steps; the sequence's caches hold exactly its `live.tokens`."""
        if not self.seqs:
            self.seqs.append(seq)
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
        """One decode step for every sequence: cancellations, one pass, reads, departures."""
        for seq in self.seqs:
            if seq.req.cancelled.is_set():
                seq.cancel()
            else:
                seq.read_first()
        self._leave()
        if not self.seqs:
            return
        for seq in self.seqs:
            seq.timings.batch_peak = max(seq.timings.batch_peak, len(self.seqs))
        if any(seq.wants_forward() for seq in self.seqs):
            self._forward()
            for seq in self.seqs:
                seq.read_after()
        else:
            for seq in self.seqs:
                seq.read_unfed()
        self._leave()

    def fail_all(self) -> list[Sequence]:
        """After a failed pass: the batch's state is unknown, so every sequence leaves."""
        failed, self.seqs, self._merged = self.seqs, [], None
        return failed

    # ------------------------------------------------------------------------------------
    def _forward(self) -> None:
        if self._merged is None:
            (seq,) = self.seqs
            tokens = seq.inputs(one=False)[None]
            seq.after_pass(self.model(tokens, cache=seq.live.caches)[:, -1, :])
            return
        tokens = mx.concatenate([seq.inputs(one=True) for seq in self.seqs])[:, None]
        logits = self.model(tokens, cache=self._merged)[:, -1, :]
        for i, seq in enumerate(self.seqs):
            seq.after_pass(logits[i : i + 1])

    def _leave(self, *, report: bool = True) -> None:
        """Cut the sequences that ended out of the batch, then report them."""
        ended = [i for i, seq in enumerate(self.seqs) if seq.done]
        if not ended:
            return
        gone = [self.seqs[i] for i in ended]
        if self._merged is not None:
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
        for seq in gone if report else ():
            self.on_end(seq)
