"""How many tokens a row drafts: the depth whose expected tokens per unit of cost is highest.

Speculation only pays when the tokens a verify pass yields outweigh what the wider pass costs:
prompt lookup on prose rarely hits, a full batch has no spare compute, and a long context makes
every pass dearer. So nothing is assumed; both sides are measured online:

- `DepthController` (one per row): acceptance, position by position. rate(i) is the chance that
  draft i+1 is kept given drafts 1..i were, from decayed counts, so a row that turns from prose
  to re-emitting a file adapts within tens of rounds. Positions never tried borrow the rate of
  the position before them (a weak prior). Expected tokens from depth k:
  E(k) = 1 + sum_{j=1..k} prod_{i<j} rate(i) (the 1 is the token the pass yields anyway).
- `VerifyCost` (one per engine): c(B, w), the time of a pass feeding w tokens per row over the
  time of a plain decode pass (w = 1), at batch size B, from timed passes; widths not measured
  yet are interpolated, or extrapolated from a prior slope.

Depth = argmax_k E(k) / c(B, k+1) over 0..cap, and 0 unless the best beats plain decoding by
`margin` (never lose). A row at depth 0 gathers no evidence, so it probes a small depth after a
backoff that doubles after each probe that did not pay (4 to 512 rounds, as Ollama's
`speculate_depth.go` does) and resets once drafting pays again.

In a merged batch every row feeds the same width, so the width is chosen for the cohort:
`plan_width` maximises the sum of the rows' E_i(w-1) over c(B, w).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

PROBE_DEPTH = 2


class VerifyCost:
    """c(B, w): a pass of width w over a plain decode pass, per batch size, measured online."""

    def __init__(self, prior_slope: float = 0.06, decay: float = 0.8) -> None:
        """`prior_slope`: the cost of each extra position per row before any is measured (this
        machine's default model: 4 tokens 1.05-1.17x, 8 tokens 1.35-1.47x); `decay`: the weight
        an old measurement keeps when a new one arrives."""
        self.prior_slope = prior_slope
        self.decay = decay
        self._seconds: dict[int, dict[int, float]] = {}  # batch -> width -> smoothed seconds

    def observe(self, batch: int, width: int, seconds: float) -> None:
        """A pass of `width` tokens per row over `batch` rows took `seconds`."""
        widths = self._seconds.setdefault(batch, {})
        old = widths.get(width)
        widths[width] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def plain(self, batch: int) -> float | None:
        """The smoothed seconds of a plain pass at `batch` rows, if one was timed."""
        return self._seconds.get(batch, {}).get(1)

    def cost(self, batch: int, width: int) -> float:
        """Relative cost of a width-`width` pass; 1.0 for width 1."""
        if width <= 1:
            return 1.0
        widths = self._seconds.get(batch, {})
        plain = widths.get(1)
        if plain is None or plain <= 0:
            return 1.0 + self.prior_slope * batch**0.5 * (width - 1)
        points = sorted((w, s / plain) for w, s in widths.items())
        below = max((p for p in points if p[0] <= width), default=(1, 1.0))
        above = min((p for p in points if p[0] >= width), default=None)
        if above is None:  # past the widest measured: continue at the prior slope
            return below[1] + self.prior_slope * batch**0.5 * (width - below[0])
        if above[0] == below[0]:
            return below[1]
        t = (width - below[0]) / (above[0] - below[0])
        return below[1] + t * (above[1] - below[1])


class DepthController:
    """One row's acceptance, position by position, and the depth it should draft next."""

    def __init__(
        self,
        max_depth: int = 8,
        *,
        prior: float = 0.5,
        strength: float = 2.0,
        decay: float = 0.95,
        margin: float = 0.05,
        backoff: tuple[int, int] = (4, 512),
    ) -> None:
        """`prior`, `strength`: the first position's rate before evidence, as pseudo-counts;
        `decay`: the weight old rounds keep per new round; `margin`: how much better than plain
        decoding the best depth must be; `backoff`: the first and the longest wait between
        probes while the depth is 0."""
        self.max_depth = max_depth
        self.prior, self.strength, self.decay, self.margin = prior, strength, decay, margin
        self.tried = [0.0] * max_depth  # decayed count of rounds that drafted position i
        self.kept = [0.0] * max_depth  # ... and kept it
        self.drafted = self.accepted = 0  # totals, for the log line and metrics
        self._backoff, self._wait = backoff, backoff[0]
        self._idle = 0  # rounds at depth 0 since the last probe

    def rate(self, i: int) -> float:
        """P(draft i+1 kept | drafts 1..i kept), from the decayed counts and the prior."""
        before = self.prior if i == 0 else self.rate(i - 1)
        return (self.kept[i] + self.strength * before) / (self.tried[i] + self.strength)

    def expected(self, k: int) -> list[float]:
        """E(0..k): the tokens a verify pass is expected to yield at each depth."""
        out, alive = [1.0], 1.0
        for i in range(min(k, self.max_depth)):
            alive *= self.rate(i)
            out.append(out[-1] + alive)
        return out

    def best(self, cost: Callable[[int], float], cap: int) -> int:
        """argmax_k E(k) / cost(k+1) over 0..cap; 0 unless it beats 1.0 by the margin."""
        gains = [e / cost(k + 1) for k, e in enumerate(self.expected(cap))]
        k = max(range(len(gains)), key=gains.__getitem__)
        return k if gains[k] > 1.0 + self.margin else 0

    def depth(self, cost: Callable[[int], float], cap: int | None = None) -> int:
        """The depth to draft this round (`cost(w)`: the relative cost of width w for this
        batch); while the best is 0, a probe once the backoff has passed."""
        cap = self.max_depth if cap is None else min(cap, self.max_depth)
        k = self.best(cost, cap)
        if k > 0 or cap == 0:
            self._idle, self._wait = 0, self._backoff[0]
            return k
        self._idle += 1
        if self._idle < self._wait:
            return 0
        self._idle = 0
        self._wait = min(self._wait * 2, self._backoff[1])
        return min(PROBE_DEPTH, cap)

    def record(self, drafted: int, accepted: int) -> None:
        """A round drafted `drafted` tokens (after any shortening by the source) and kept
        `accepted`."""
        assert 0 <= accepted <= drafted <= self.max_depth
        if drafted == 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.tried = [t * self.decay for t in self.tried]
        self.kept = [t * self.decay for t in self.kept]
        for i in range(min(drafted, accepted + 1)):  # positions past the first miss: untried
            self.tried[i] += 1
            self.kept[i] += i < accepted


def plan_width(
    curves: Sequence[Sequence[float]], cost: Callable[[int], float], margin: float = 0.03
) -> int:
    """The width for a merged batch: argmax_w sum_i E_i(w-1) / cost(w), w >= 1; 1 (plain
    decoding) unless the best beats it by `margin`.

    `curves[i]` is row i's E(0..k_i) (a row without a draft: [1.0]); a row's expectation past
    its own curve is its last value, since it has nothing more to draft.
    """
    longest = max((len(c) for c in curves), default=1)

    def gain(w: int) -> float:
        return sum(c[min(w - 1, len(c) - 1)] for c in curves) / cost(w)

    w = max(range(1, longest + 1), key=gain)
    return w if gain(w) > gain(1) * (1.0 + margin) else 1
