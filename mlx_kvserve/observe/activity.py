"""What the status page shows of the requests: the recent ones, totals, and per-second series.

The engine thread records each finished request (as the Prometheus metrics do, from the same
`Timings`); the event loop reads a snapshot for `/v1/status`. Everything is bounded: the last
`keep` requests and the last `window` seconds of the series.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mlx_kvserve.engine import GenerationRequest
from mlx_kvserve.engine.live import Timings
from mlx_kvserve.json_value import JSON


@dataclass(frozen=True)
class Finished:
    """One finished request, as the page lists it."""

    id: str
    kind: str
    model: str
    ended: float  # unix time
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_seconds: float
    decode_tps: float
    cache_source: str
    finish_reason: str

    def as_dict(self) -> dict[str, JSON]:
        share = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {**self.__dict__, "cached_share": share}


class Activity:
    """Recent requests and live series; `record` on the engine thread, `snapshot` anywhere."""

    def __init__(
        self, keep: int = 50, window: int = 300, clock: Callable[[], float] = time.time
    ) -> None:
        self._lock = threading.Lock()
        self._recent: deque[Finished] = deque(maxlen=keep)
        self._window = window
        self._clock = clock
        # per whole second: [second, generated tokens, sum of TTFTs, requests with a TTFT]
        self._seconds: deque[list[float]] = deque()
        self.totals = {
            "requests": 0,
            "failed": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "prefill_seconds_saved": 0.0,
            "drafted_tokens": 0,  # speculative decoding, as /metrics counts it
            "accepted_tokens": 0,
            "verify_passes": 0,
        }
        self._prefill_rate = 0.0  # recent seconds per prefilled token (for seconds saved)
        self._by_source: dict[str, list[int]] = {}  # draft source -> [drafted, kept, passes]

    def record(self, model: str, req: GenerationRequest, timings: Timings | None) -> None:
        """An engine observer (`Engine.add_observer`) once `model` is bound: the served name of
        that engine's model (the request does not say which model served it)."""
        now = self._clock()
        with self._lock:
            if timings is None:
                self.totals["failed"] += 1
                return
            t = timings
            decode_tps = (
                (t.completion_tokens - 1) / t.decode_seconds
                if t.completion_tokens > 1 and t.decode_seconds > 0
                else 0.0
            )
            self._recent.append(
                Finished(
                    id=str(req.request_id),
                    kind=str(req.kind),
                    model=model,
                    ended=now,
                    prompt_tokens=t.prompt_tokens,
                    cached_tokens=t.cached_tokens,
                    completion_tokens=t.completion_tokens,
                    ttft_seconds=t.ttft_seconds,
                    decode_tps=decode_tps,
                    cache_source=t.cache_source,
                    finish_reason=t.finish_reason,
                )
            )
            prefilled = t.prompt_tokens - t.cached_tokens
            if prefilled > 0 and t.prefill_seconds > 0:
                rate = t.prefill_seconds / prefilled
                self._prefill_rate = (
                    rate if not self._prefill_rate else 0.8 * self._prefill_rate + 0.2 * rate
                )
            totals = self.totals
            totals["requests"] += 1
            totals["prompt_tokens"] += t.prompt_tokens
            totals["cached_tokens"] += t.cached_tokens
            totals["generated_tokens"] += t.completion_tokens
            totals["prefill_seconds_saved"] += t.cached_tokens * self._prefill_rate
            totals["drafted_tokens"] += t.drafted
            totals["accepted_tokens"] += t.accepted
            totals["verify_passes"] += t.verify_passes
            for source, counts in t.by_source.items():
                mine = self._by_source.setdefault(source, [0, 0, 0])
                for i, n in enumerate(counts):
                    mine[i] += n
            second = self._second(now)
            second[1] += t.completion_tokens
            if t.completion_tokens > 0 and t.ttft_seconds > 0:
                second[2] += t.ttft_seconds
                second[3] += 1

    def _second(self, now: float) -> list[float]:
        whole = float(int(now))
        if not self._seconds or self._seconds[-1][0] != whole:
            self._seconds.append([whole, 0.0, 0.0, 0.0])
        while self._seconds and self._seconds[0][0] <= whole - self._window:
            self._seconds.popleft()
        return self._seconds[-1]

    def snapshot(self) -> dict[str, JSON]:
        """Recent requests (newest first), totals, and the series of the last window: generated
        tokens per second and mean time to first token, one point per second with activity."""
        with self._lock:
            self._second(self._clock())
            seconds = [s for s in self._seconds if s[1] or s[3]]
            totals = dict(self.totals)
            drafted, accepted, passes = (
                totals["drafted_tokens"],
                totals["accepted_tokens"],
                totals["verify_passes"],
            )
            return {
                "recent": [f.as_dict() for f in reversed(self._recent)],
                "totals": totals,
                "speculation": {  # None until something was drafted
                    "acceptance_rate": accepted / drafted if drafted else None,
                    "tokens_per_pass": (accepted + passes) / passes if passes else None,
                    "by_source": {  # drafts.py's, continuations.py's, draft_model.py's
                        source: {
                            "drafted": d,
                            "accepted": a,
                            "passes": n,
                            "acceptance_rate": a / d if d else None,
                        }
                        for source, (d, a, n) in self._by_source.items()
                    },
                },
                "series": {
                    "time": [s[0] for s in seconds],
                    "tokens_per_second": [s[1] for s in seconds],
                    "ttft_seconds": [s[2] / s[3] if s[3] else None for s in seconds],
                },
            }
