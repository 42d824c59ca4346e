"""What one row feeds a verify pass, and where its samples are read (engine/speculation/step.py).

A row feeds its pending tokens (`Sequence.feed`: the token read last, then any its grammar
forced after it), then its drafts, each followed by the tokens its grammar forces after it
(`Decoder.walk`). Forced tokens are fed and never sampled, as in plain decoding, so a row's
samples are read at "slots": the position of its last pending token, then the last position of
each draft with its forced tokens. Without a grammar, the slots are simply positions 0..k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mlx_kvserve.engine.sequence import Sequence


@dataclass
class Plan:
    """One row's part of a verify pass."""

    feed: list[int]  # pending tokens, already taken by the grammar and emitted
    drafts: list[int] = field(default_factory=list)  # checked against the row's samples
    forced: list[list[int]] = field(default_factory=list)  # after each draft: fed, not sampled
    masks: list[mx.array | None] | None = None  # the grammar's mask at each slot (None: any)

    def __post_init__(self) -> None:
        if not self.forced:
            self.forced = [[] for _ in self.drafts]

    def cut(self, width: int) -> Plan:
        """The drafts that fit a pass `width` wide (its pending token and width - 1 more): a
        draft's forced tokens count, so a row whose drafts are often rejected does not feed
        long forced runs in vain."""
        n = 0
        used = 1
        while n < len(self.drafts) and used + 1 + len(self.forced[n]) <= width:
            used += 1 + len(self.forced[n])
            n += 1
        masks = None if self.masks is None else self.masks[: n + 1]
        return Plan(self.feed, self.drafts[:n], self.forced[:n], masks)

    def inputs(self) -> list[int]:
        return self.feed + [
            t for d, f in zip(self.drafts, self.forced, strict=True) for t in (d, *f)
        ]

    def slots(self) -> list[int]:
        """The positions whose logits the row samples from: len(drafts) + 1 of them."""
        out = [len(self.feed) - 1]
        for forced in self.forced:
            out.append(out[-1] + 1 + len(forced))
        return out


def slot_logits(logits: mx.array, plans: list[Plan], slots: int) -> mx.array:
    """(B, slots, V): each row's logits at its slots (a shorter row repeats its last slot)."""
    index = []
    for plan in plans:
        own = plan.slots()
        index.append(own + [own[-1]] * (slots - len(own)))
    if all(row == list(range(slots)) for row in index):
        return logits[:, :slots]
    return mx.take_along_axis(logits, mx.array(index)[:, :, None], axis=1)


def row_masks(seqs: list[Sequence], plans: list[Plan], vocab: int, slots: int) -> mx.array | None:
    """(B, slots, vocab) the tokens each row may take at each slot, or None when no row masks
    any: a grammar row's walked masks; an `ignore_eos` row's (every id but the end ones) is the
    same at every slot, its plain step's mask repeated."""
    every = mx.ones((vocab,), dtype=mx.bool_)
    rows: list[mx.array | None] = []
    for seq, plan in zip(seqs, plans, strict=True):
        if plan.masks is not None:
            own = [every if m is None else m[:vocab] for m in plan.masks]
            rows.append(mx.stack(own + [every] * (slots - len(own))))
        else:
            mask = seq.decoder.mask(vocab, False)
            rows.append(None if mask is None else mx.broadcast_to(mask, (slots, vocab)))
    if all(r is None for r in rows):
        return None
    return mx.stack([mx.broadcast_to(every, (slots, vocab)) if r is None else r for r in rows])
