"""Admission by what requests really hold: pure arithmetic, no MLX (unit-testable with numbers).

A request's KV grows with it: its prompt once prefilled, then one position per generated token.
Charging every request its prompt plus its whole `max_tokens` up front (a request without one
may generate up to the end of the context window) refused ordinary agent requests on real
Macs: Claude Code sends `max_tokens` 32000, Codex none. Instead a request holds

* its prompt plus a **growth reserve** of `reserve` tokens (or its `max_tokens`, if smaller)
  from admission on, and
* another `reserve` tokens each time it reaches the end of what it holds, while the budget
  allows; 256 tokens is the step in which mlx-lm's `KVCache` allocates anyway.

When a running request cannot grow, the **youngest** running request (the last admitted) is
paused: the engine checkpoints its KV, frees it, and resumes it once there is room again, from
its checkpoint. Its client only sees a slower stream. A request alone in the server that fills
the whole budget ends with finish reason "length", as at the end of the context window. A
request whose prompt alone cannot fit is refused (a 400) before it is queued.

Bytes per position come from the layer descriptions (`cache.kinds.LayerKind`, asked of the
caches; or `models.kv_shape` for a config.json): KV that grows per token costs per position;
a sliding window costs per position up to its length and no more; a recurrent state costs the
same at any length. In a merged decode batch every row is padded on the left to the longest row
(`BatchKVCache`), so when the model batches (`batched`), every running request is charged the
longest reservation: those still prefilling join the batch as soon as they are done, and a
join must never take more than admission allowed.

Beside the requests, the same unified memory holds copies the budget counts too (`extras`):
resident sessions, the RAM tier of the prompt cache and host copies still queued for the disk.
Some are reclaimable (`SHEDDABLE`: the engine drops them before pausing anyone).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

TOKENS, WINDOW, STATE = "tokens", "window", "state"  # as cache/kinds.py names them
RESERVE_TOKENS = 256  # growth reserve: mlx-lm's KVCache allocates in steps of 256 positions
SHEDDABLE = ("resident_sessions", "ram_tier")  # copies the engine can drop to make room


class LayerLike(Protocol):
    kind: str
    bytes_per_token: int
    fixed_bytes: int
    window: int | None


@dataclass(frozen=True)
class KVCost:
    """Bytes a sequence of a given length holds, summed over the model's layers."""

    per_token: int  # layers whose KV grows per token
    windows: tuple[tuple[int, int], ...] = ()  # (bytes per position, length) per window layer
    state_bytes: int = 0  # recurrent states: the same at any length

    @classmethod
    def of(cls, layers: Iterable[LayerLike]) -> KVCost:
        per_token, windows, state = 0, [], 0
        for layer in layers:
            if layer.kind == TOKENS:
                per_token += layer.bytes_per_token
                state += layer.fixed_bytes  # a CacheList's state parts
            elif layer.kind == WINDOW and layer.window:
                windows.append((layer.bytes_per_token, int(layer.window)))
                state += max(0, layer.fixed_bytes - layer.bytes_per_token * int(layer.window))
            else:
                state += layer.fixed_bytes
        return cls(per_token, tuple(windows), state)

    def bytes_for(self, tokens: int) -> int:
        """What a sequence of `tokens` positions holds."""
        tokens = max(0, int(tokens))
        windowed = sum(per * min(tokens, length) for per, length in self.windows)
        return self.per_token * tokens + windowed + self.state_bytes

    @property
    def bytes_per_token_full(self) -> int:
        """What one more token adds once every window is full."""
        return self.per_token

    def tokens_within(self, budget: int) -> int:
        """The longest sequence that fits in `budget` bytes (0 if not even an empty one)."""
        if self.bytes_for(0) > budget:
            return 0
        if self.per_token == 0 and not self.windows:
            return 1 << 62  # nothing grows: any length fits
        lo, hi = 0, 1
        while self.bytes_for(hi) <= budget:
            if self.per_token == 0 and hi > max(length for _, length in self.windows):
                return 1 << 62  # every window is full and nothing else grows
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.bytes_for(mid) <= budget else (lo, mid)
        return lo


@dataclass
class Hold:
    """What one running request is charged for."""

    rid: Hashable
    order: int  # admission order: the larger, the younger
    tokens: int  # positions its KV holds now
    reserved: int  # positions reserved for it (>= tokens)


class Ledger:
    """The bytes the running requests and the other copies hold, within `budget`."""

    def __init__(
        self, cost: KVCost, budget: int, reserve: int = RESERVE_TOKENS, batched: bool = True
    ) -> None:
        self.cost = cost
        self.batched = batched  # the requests decode as rows of one merged batch
        self.budget = max(0, int(budget))
        self.reserve = max(1, int(reserve))
        self.holds: dict[Hashable, Hold] = {}
        self.extras: dict[str, int] = {}
        self._order = 0

    # -- what is held -------------------------------------------------------------------------
    def held(self, holds: Iterable[Hold] | None = None) -> int:
        """Bytes of the requests' KV: each at its reservation, or, as rows of one merged batch
        (two or more of a model that batches), each at the longest (left padding)."""
        reserved = [h.reserved for h in (self.holds.values() if holds is None else holds)]
        if self.batched and len(reserved) > 1:
            return len(reserved) * self.cost.bytes_for(max(reserved))
        return sum(self.cost.bytes_for(r) for r in reserved)

    def padding(self) -> int:
        """Bytes of the rows' left padding (part of `held`)."""
        return self.held() - sum(self.cost.bytes_for(h.reserved) for h in self.holds.values())

    def total(self) -> int:
        return self.held() + sum(self.extras.values())

    def fixed_extras(self) -> int:
        """Copies that cannot be dropped now (host copies queued for the disk)."""
        return sum(v for k, v in self.extras.items() if k not in SHEDDABLE)

    def report(self) -> dict[str, int]:
        """The accounted parts, for /v1/cache and /health."""
        return {
            "budget_bytes": self.budget,
            "requests_bytes": self.held(),
            "padding_bytes": self.padding(),
            **{f"{k}_bytes": int(v) for k, v in sorted(self.extras.items())},
            "total_bytes": self.total(),
            "running": len(self.holds),
        }

    def set_extra(self, name: str, nbytes: int) -> None:
        self.extras[name] = max(0, int(nbytes))

    # -- decisions ----------------------------------------------------------------------------
    def first_reserve(self, prompt_tokens: int, max_tokens: int) -> int:
        return int(prompt_tokens) + max(1, min(self.reserve, int(max_tokens)))

    def fits_alone(self, prompt_tokens: int, fixed: int | None = None) -> bool:
        """Whether a prompt could ever run here: it and one generated token, alone, beside the
        copies that cannot be dropped (`fixed`: as counted earlier; default: now)."""
        fixed = self.fixed_extras() if fixed is None else fixed
        return self.cost.bytes_for(int(prompt_tokens) + 1) + fixed <= self.budget

    def most_tokens(self, fixed: int | None = None) -> int:
        """The longest sequence one request alone may hold (`fixed` as in `fits_alone`)."""
        fixed = self.fixed_extras() if fixed is None else fixed
        return self.cost.tokens_within(self.budget - fixed)

    def shortfall(self, prompt_tokens: int, max_tokens: int) -> int:
        """Bytes missing to admit a request now (0: it fits)."""
        new = Hold("", 0, prompt_tokens, self.first_reserve(prompt_tokens, max_tokens))
        need = self.held([*self.holds.values(), new]) + sum(self.extras.values())
        return max(0, need - self.budget)

    def admit(
        self, rid: Hashable, prompt_tokens: int, max_tokens: int, order: int | None = None
    ) -> Hold:
        """Charge `rid` its prompt plus its first reserve (the caller checked `shortfall`).
        `order` keeps a resumed request's age."""
        if order is None:
            self._order += 1
            order = self._order
        hold = Hold(rid, order, int(prompt_tokens), self.first_reserve(prompt_tokens, max_tokens))
        self.holds[rid] = hold
        return hold

    def grow(self, rid: Hashable, tokens: int, limit: int | None = None) -> bool:
        """`rid` is about to hold `tokens` positions: extend its reserve by whole steps if
        needed (not past `limit` tokens); False if that does not fit (nothing changes)."""
        hold = self.holds[rid]
        if tokens <= hold.reserved:
            hold.tokens = max(hold.tokens, int(tokens))
            return True
        steps = -(-(tokens - hold.reserved) // self.reserve)
        wanted = hold.reserved + steps * self.reserve
        if limit is not None:
            wanted = max(int(tokens), min(wanted, int(limit)))
        old = hold.reserved
        hold.reserved = wanted
        if self.total() > self.budget:
            hold.reserved = old
            return False
        hold.tokens = int(tokens)
        return True

    def finish(self, rid: Hashable) -> Hold | None:
        return self.holds.pop(rid, None)

    def youngest(self, among: Iterable[Hashable]) -> Hashable | None:
        """The last admitted of `among` (what to pause when memory runs out)."""
        holds = [self.holds[r] for r in among if r in self.holds]
        return max(holds, key=lambda h: h.order).rid if holds else None

    def plan_step(
        self,
        needs: Mapping[Hashable, int],
        pausable: Iterable[Hashable],
        limits: Mapping[Hashable, int] = {},
    ) -> tuple[list[Hashable], list[Hashable]]:
        """Before a decode step: each running request in `needs` is about to hold that many
        positions. Grow their reserves, pausing the youngest pausable requests (they leave the
        ledger) until every remaining one fits. Returns (paused, full): `full` are requests
        that could not grow even with no one else left to pause (they end: no more memory)."""
        paused: list[Hashable] = []
        full: list[Hashable] = []
        candidates = [r for r in pausable if r in self.holds]
        for rid in sorted(needs, key=lambda r: self.holds[r].order):
            while rid in self.holds and not self.grow(rid, needs[rid], (limits or {}).get(rid)):
                victim = self.youngest([*(r for r in candidates if r in self.holds), rid])
                if victim == rid and len(self.holds) == 1:
                    full.append(rid)  # alone, and the budget is spent
                    break
                assert victim is not None
                self.finish(victim)
                paused.append(victim)
        return paused, full


MIN_BUDGET = 256 << 20


def default_budget(memory: int, weights: int) -> int:
    """`--kv-budget auto`: half of the memory left beside the weights (the other half stays
    for the system, other programs and MLX's own buffers); `memory` is the GPU's recommended
    working set on Metal (about 2/3 to 3/4 of RAM), physical memory on the CPU."""
    return max((memory - weights) // 2, MIN_BUDGET)


def describe(layers: Iterable[LayerLike]) -> dict[str, int]:
    """Bytes per token of each layer kind, e.g. for the start-up log and the docs table."""
    out = {TOKENS: 0, WINDOW: 0, STATE: 0}
    for layer in layers:
        if layer.kind == STATE:
            out[STATE] += layer.fixed_bytes
        else:
            out[layer.kind] += layer.bytes_per_token
    return out
