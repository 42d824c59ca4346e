"""Speculation across the ranks of a job: every rank drafts, verifies and accepts alike.

ENGINE THREAD. Each rank of a job runs the same decode step on its shard (engine/lockstep.py),
so every choice a speculative step makes must come out the same on every rank: whether it
speculates, each row's draft, the pass's width, the tokens kept. All of them are functions of
the rows' tokens (prompt lookup, the continuations of requests finished in this run, grammar
walks), of their acceptance counts (the depth controllers) and of logits and seeded draws that
are equal on every rank, with one exception: the verify cost (`VerifyCost`), which each rank
would time on its own clock, so a rank whose passes ran slower would choose shallower drafts
and fall out of step (a hang in the next collective, or a divergence).

`AgreedCost` removes it: a rank's own timings are only collected, and at the next decode step
rank 0's travel in the turn's decisions (`decide`) and every rank observes those. The
controllers then see the same costs at the same step everywhere; the turn's digest carries
each row's drafted and accepted counts (engine/worker.py), so a rank that drafted otherwise is
named at the next turn. A rank whose tokens differ (it drew another token) drafts otherwise
in the very step that reads the token, so each decode pass's shape is compared first
(`CheckedPasses`): that rank ends the job naming the request, as the digest would have.

What a job does not speculate with: a draft model or MTP heads (each rank would run its own
unsharded passes and time them), the stored entries' continuations at start (each rank's own
disk cache, which may hold other entries), and merged rows on a recurrent model (whether they
replay exactly is a check each rank would run alone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx

from mlx_kvserve.engine import faults
from mlx_kvserve.engine.speculation.depth import VerifyCost
from mlx_kvserve.json_value import JSON

T = TypeVar("T")
Decide = Callable[[Callable[[], T]], T]  # a turn's `decide`: rank 0's value on every rank
SLOWER = 1000.0  # `verify_cost_otherwise`: this rank's verify passes seem this much dearer


class AgreedCost(VerifyCost):
    """A `VerifyCost` that observes rank 0's step timings on every rank (see above)."""

    def __init__(self, prior_slope: float = 0.06, decay: float = 0.8) -> None:
        super().__init__(prior_slope, decay)
        self._timed: list[JSON] = []  # this rank's own, since the last agreement

    def observe(self, batch: int, width: int, seconds: float) -> None:
        """Kept until `agree`: only rank 0's timing counts."""
        if width > 1 and faults.fires("verify_cost_otherwise"):  # a slower rank (tests)
            seconds *= SLOWER
        self._timed.append([batch, width, seconds])

    def agree(self, decide: Decide) -> None:
        """Before a decode step: observe the timings rank 0 took since the last one."""
        mine, self._timed = self._timed, []
        for batch, width, seconds in decide(lambda: mine):
            super().observe(int(batch), int(width), float(seconds))


class CheckedPasses:
    """The decode batch's model in a job that speculates: before each pass, `check` compares its
    shape across the ranks (engine/lockstep.py `Lockstep.same_pass`). Ranks whose tokens
    differ (one drew another token) draft otherwise from the step that read it, so their next
    passes would not match: a hang or garbage in the collective instead of the clear line the
    turn's digest gives one turn later."""

    def __init__(self, model: Callable[..., mx.array], check: Callable[[list[int]], None]):
        self.model = model
        self.check = check

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        self.check(list(inputs.shape))
        return self.model(inputs, cache=cache)

    def __getattr__(self, name: str) -> object:
        return getattr(self.model, name)


__all__ = ["AgreedCost", "CheckedPasses"]
