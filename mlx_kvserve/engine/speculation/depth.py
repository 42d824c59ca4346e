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

A new row knows nothing of itself, so its rates start from `SourcePriors`: what rows of the
engine kept before from the source (and match length) its draft would come from, as decayed
counts shared by every row (a story's 2-token lookup matches were seldom kept, a file's 4-token
ones mostly), instead of a flat prior. A pipelined row must read its pending token before it can
draft, which gives up the overlap of the pass with the readback; when the read then finds no
draft the step paid that for one token. The controller weighs it: h, the chance a read-first
ends in a draft (the row's decayed counts over its source's shared ones), and c_0, such a
step's time over a plain step's (`VerifyCost.read_first`, timed), so a row's gain at depth
k > 0 is (h E(k) + 1 - h) / (h c(k+1) + (1 - h) c_0).

In a merged batch every row feeds the same width, so the width is chosen for the cohort:
`plan_width` maximises the sum of the rows' E_i(w-1) over c(B, w).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

PROBE_DEPTH = 2
READ_FIRST = 0  # VerifyCost's width for a plain step whose pending tokens were read first
RETIME = 64  # verify passes at a batch size after which its plain pass is timed again


class VerifyCost:
    """c(B, w): a pass of width w over a plain decode pass, per batch size, measured online."""

    retime: int | None = RETIME  # None: never ask for a plain step (tests pin the prior so)

    def __init__(self, prior_slope: float = 0.06, decay: float = 0.8) -> None:
        """`prior_slope`: the cost of each extra position per row before any is measured (this
        machine's default model: 4 tokens 1.05-1.17x, 8 tokens 1.35-1.47x); `decay`: the weight
        an old measurement keeps when a new one arrives."""
        self.prior_slope = prior_slope
        self.decay = decay
        self._seconds: dict[int, dict[int, float]] = {}  # batch -> width -> smoothed seconds
        self._wide: dict[int, int] = {}  # batch -> verify passes since its last plain pass

    def observe(self, batch: int, width: int, seconds: float) -> None:
        """A pass of `width` tokens per row over `batch` rows took `seconds`."""
        widths = self._seconds.setdefault(batch, {})
        old = widths.get(width)
        widths[width] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        if width == 1:
            self._wide[batch] = 0
        elif width > 1:
            self._wide[batch] = self._wide.get(batch, 0) + 1

    def untimed(self, batch: int) -> bool:
        """Whether the next step of `batch` rows should be a plain one, to time it: its plain
        pass never was (a lone row copying a file from its first token, or agents copying
        together, draft at every step, and their wide passes would be priced on the prior for
        ever: on a CPU a 17-wide pass of a 262k-vocabulary model costs several plain ones, not
        the prior's 2), or not since `retime` verify passes (a plain pass grows dearer with the
        context). One step in `retime` + 1 drafts nothing."""
        if self.retime is None:
            return False
        return self.plain(batch) is None or self._wide.get(batch, 0) >= self.retime

    def read_first(self, batch: int) -> float:
        """c_0: a plain step whose rows' pending tokens were read first (no draft came of it),
        over a pipelined plain step; before both are timed, one extra position's prior."""
        widths = self._seconds.get(batch, {})
        plain, read = widths.get(1), widths.get(READ_FIRST)
        if plain is None or read is None or plain <= 0:
            return 1.0 + self.prior_slope * batch**0.5
        return max(1.0, read / plain)

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
        points = sorted((w, s / plain) for w, s in widths.items() if w >= 1)
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
        self.reads = self.hits = 0.0  # decayed: read-first steps, and those that drafted
        self.base: Sequence[float] | None = None  # the shared prior per position (SourcePriors)
        self.firsts: dict[Hashable, list[float]] = {}  # key -> decayed [tried, kept] of draft 1
        self._backoff, self._wait = backoff, backoff[0]
        self._idle = 0  # rounds at depth 0 since the last probe

    def rate(self, i: int) -> float:
        """P(draft i+1 kept | drafts 1..i kept), from the decayed counts and the prior (the
        shared one of the row's source at this position if given, else the flat one)."""
        if self.base is not None and i < len(self.base):
            before = self.base[i]
        else:
            before = self.prior if i == 0 else self.rate(i - 1)
        return (self.kept[i] + self.strength * before) / (self.tried[i] + self.strength)

    def hit_rate(self, prior: float) -> float:
        """h: the chance that reading the pending token first ends in a draft."""
        return (self.hits + self.strength * prior) / (self.reads + self.strength)

    def read(self, hit: bool) -> None:
        """A step read this row's pending token first so that it could draft; `hit`: it did."""
        self.reads = self.reads * self.decay + 1
        self.hits = self.hits * self.decay + hit

    def expected(self, k: int) -> list[float]:
        """E(0..k): the tokens a verify pass is expected to yield at each depth."""
        out, alive = [1.0], 1.0
        for i in range(min(k, self.max_depth)):
            alive *= self.rate(i)
            out.append(out[-1] + alive)
        return out

    def best(
        self, cost: Callable[[int], float], cap: int, hit: float = 1.0, miss: float = 1.0
    ) -> int:
        """argmax_k of the gain over 0..cap; 0 unless it beats 1.0 by the margin. `hit`: h,
        the chance a round that asks for a draft gets one; `miss`: c_0, what a round that
        does not costs (module docstring)."""
        gains = [1.0] + [
            (hit * e + 1.0 - hit) / (hit * cost(k + 1) + (1.0 - hit) * miss)
            for k, e in enumerate(self.expected(cap)[1:], start=1)
        ]
        k = max(range(len(gains)), key=gains.__getitem__)
        return k if gains[k] > 1.0 + self.margin else 0

    def depth(
        self,
        cost: Callable[[int], float],
        cap: int | None = None,
        *,
        prior: Sequence[float] | None = None,
        hit: float = 1.0,
        miss: float = 1.0,
    ) -> int:
        """The depth to draft this round (`cost(w)`: the relative cost of width w for this
        batch; `prior`: the shared rates of the source the row would draft from, per
        position; `hit`, `miss`: as `best`'s); while the best is 0, a probe once the
        backoff has passed."""
        cap = self.max_depth if cap is None else min(cap, self.max_depth)
        self.base = prior
        k = self.best(cost, cap, hit, miss)
        if k > 0 or cap == 0:
            self._idle, self._wait = 0, self._backoff[0]
            return k
        self._idle += 1
        if self._idle < self._wait:
            return 0
        self._idle = 0
        self._wait = min(self._wait * 2, self._backoff[1])
        return min(PROBE_DEPTH, cap)

    def worth(self, key: Hashable, shared: float) -> float:
        """This row's kept rate of first drafts from `key` (source, match length), from the
        engine's (`shared`) before it has its own."""
        tried, kept = self.firsts.get(key, (0.0, 0.0))
        return (kept + self.strength * shared) / (tried + self.strength)

    def record(self, drafted: int, accepted: int, key: Hashable = None) -> None:
        """A round drafted `drafted` tokens (after any shortening by the source `key`) and
        kept `accepted`."""
        assert 0 <= accepted <= drafted <= self.max_depth
        if drafted == 0:
            return
        if key is not None:
            first = self.firsts.setdefault(key, [0.0, 0.0])
            first[0] = first[0] * self.decay + 1
            first[1] = first[1] * self.decay + (accepted > 0)
        self.drafted += drafted
        self.accepted += accepted
        self.tried = [t * self.decay for t in self.tried]
        self.kept = [t * self.decay for t in self.kept]
        for i in range(min(drafted, accepted + 1)):  # positions past the first miss: untried
            self.tried[i] += 1
            self.kept[i] += i < accepted


class SourcePriors:
    """What rows of one engine kept, by draft source (and match length): decayed counts
    shared by every row, so a new row starts from what its source's drafts were worth."""

    def __init__(
        self, max_depth: int = 8, prior: float = 0.5, strength: float = 2.0, decay: float = 0.98
    ) -> None:
        """`prior`, `strength`: a source's rates before any evidence, as pseudo-counts;
        `decay`: the weight old rounds of a source keep per new round of it."""
        self.max_depth, self.prior, self.strength, self.decay = max_depth, prior, strength, decay
        # key -> [tried per position, kept per position, read-first steps, those that drafted]
        self._counts: dict[Hashable, tuple[list[float], list[float], list[float]]] = {}

    def _of(self, key: Hashable) -> tuple[list[float], list[float], list[float]]:
        found = self._counts.get(key)
        if found is None:
            found = self._counts[key] = ([0.0] * self.max_depth, [0.0] * self.max_depth, [0.0] * 2)
        return found

    def record(self, key: Hashable, drafted: int, accepted: int) -> None:
        """A row's round drafted `drafted` tokens from `key`'s source and kept `accepted`."""
        if drafted <= 0:
            return
        tried, kept, _ = self._of(key)
        for i in range(self.max_depth):
            tried[i] *= self.decay
            kept[i] *= self.decay
        for i in range(min(drafted, accepted + 1, self.max_depth)):
            tried[i] += 1
            kept[i] += i < accepted

    def read(self, key: Hashable, hit: bool) -> None:
        """A row that would have drafted from `key` read its pending token first; `hit`: it
        drafted."""
        reads = self._of(key)[2]
        reads[0] = reads[0] * self.decay + 1
        reads[1] = reads[1] * self.decay + hit

    def rates(self, key: Hashable) -> list[float] | None:
        """P(draft i+1 kept | drafts 1..i kept) per position for `key`'s source; None before
        it drafted (a row then chains its own rates from the flat prior)."""
        found = self._counts.get(key)
        if found is None or not any(found[0]):  # none drafted yet (only read first)
            return None
        out, before = [], self.prior
        for t, k in zip(found[0], found[1], strict=True):
            before = (k + self.strength * before) / (t + self.strength)
            out.append(before)
        return out

    def worth(self, source: str, evidence: int) -> float:
        """The first draft's kept rate of a source with a match of this length (the flat
        prior before it drafted)."""
        rates = self.rates((source, evidence))
        return self.prior if rates is None else rates[0]

    def hit_rate(self, key: Hashable) -> float:
        """The chance that a read-first of `key`'s source ended in a draft."""
        found = self._counts.get(key)
        reads, hits = found[2] if found is not None else (0.0, 0.0)
        return (hits + self.strength * self.prior) / (reads + self.strength)


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
