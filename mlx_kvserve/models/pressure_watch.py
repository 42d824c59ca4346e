"""Give memory back when the system runs short of it, before it swaps, in steps.

Polled every second from the app's lifespan (`run`), beside the keep-alive reaper. At normal
pressure a poll is one read of the source (a small file or one sysctl) and nothing else.

* **warn**: first every loaded model's prompt-cache RAM tier shrinks to a quarter of its budget
  (copies written to disk are dropped from RAM; the disk keeps them) and its resident sessions
  beside the newest leave (their KV is in the prompt cache), and MLX's buffer cache is freed;
  then, at each further poll still at warn, one idle unpinned model is unloaded, the least
  recently used first (its conversations come back from the prompt cache when it reloads).
* **critical**: the RAM tiers go to zero and every resident session goes, and every idle
  unpinned model is unloaded at once. A model serving requests is never unloaded for pressure:
  unloading drains it, and the requests waiting for it would load it straight back; its running
  requests always finish.
* **normal** again: the budgets come back (the models unloaded stay unloaded until asked for).

Each step writes one log line and counts in `mlx_kvserve_pressure_actions_total{action}`;
`mlx_kvserve_memory_pressure` shows the level (0 normal, 1 warn, 2 critical).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable

from mlx_kvserve.engine import Engine
from mlx_kvserve.engine.namespaces import caches_of
from mlx_kvserve.models.pool import LOADED, ModelPool, Slot
from mlx_kvserve.models.pressure import CRITICAL, NORMAL, WARN, PressureSource

log = logging.getLogger("mlx_kvserve.models")

# (share of the RAM-tier budget, share of the live budget, keep the newest resident session)
LIMITS = {WARN: (0.25, 0.0, True), CRITICAL: (0.0, 0.0, False), NORMAL: (1.0, 1.0, True)}
CALL_TIMEOUT = 30.0


class PressureWatch:
    def __init__(
        self,
        pool: ModelPool,
        source: PressureSource,
        *,
        on_level: Callable[[str], None] = lambda level: None,
        on_action: Callable[[str], None] = lambda action: None,
    ) -> None:
        self.pool = pool
        self.source = source
        self.level = NORMAL
        self._on_level = on_level
        self._on_action = on_action
        # engines whose budgets are cut, and to which level (weak: an unloaded model's engine
        # must be free to go)
        self._limited: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()

    async def run(self, every: float = 1.0) -> None:
        log.info("watching memory pressure through %s", self.source.name)
        while True:
            await asyncio.sleep(every)
            try:
                await self.check()
            except Exception:
                log.exception("memory pressure check failed")

    async def check(self) -> None:
        """One poll: read the level and take the next step it calls for."""
        level = self.source.read()
        if level != self.level:
            log.warning("memory pressure is %s (was %s)", level, self.level)
            self.level = level
            self._on_level(level)
        if level == NORMAL:
            if len(self._limited):
                await self._set_budgets(NORMAL)
            return
        if await self._set_budgets(level):
            return  # the shrink is this poll's step; unloads wait for the next poll
        for slot in self._idle_models():
            await self.pool.unload(slot, "pressure", f"memory pressure {level}")
            self._on_action("unload")
            if level == WARN:
                return  # one model per poll: see whether that was enough

    def _idle_models(self) -> list[Slot]:
        idle = [
            s for s in self.pool.slots if s.state == LOADED and not s.spec.pinned and not s.busy()
        ]
        return sorted(idle, key=lambda s: s.last_used)

    async def _set_budgets(self, level: str) -> bool:
        """Cut (or give back) the budgets of every engine not already at `level`'s; whether
        any changed."""
        changed = False
        for slot in self.pool.slots:
            engine = slot.engine
            if engine is None or not engine.ready.is_set():
                continue
            if self._limited.get(engine, NORMAL) == level:
                continue
            try:
                pending = asyncio.wrap_future(engine.call(_limit(engine, *LIMITS[level])))
                ram = await asyncio.wait_for(pending, CALL_TIMEOUT)
            except Exception as exc:  # stopping, or busy past the timeout: next poll
                log.info("memory pressure: model %s not adjusted (%s)", slot.name, exc)
                continue
            if level == NORMAL:
                self._limited.pop(engine, None)
                log.info("memory pressure normal: model %s has its budgets back", slot.name)
                self._on_action("restore")
            else:
                self._limited[engine] = level
                log.warning(
                    "memory pressure %s: model %s's prompt-cache RAM tier cut to %.0f MiB, "
                    "resident sessions %s",
                    level,
                    slot.name,
                    ram / 2**20,
                    "beside the newest dropped" if level == WARN else "all dropped",
                )
                self._on_action("shrink")
            changed = True
        return changed


def _limit(
    engine: Engine, ram_share: float, live_share: float, keep_newest: bool
) -> Callable[[], int]:
    """The engine-thread function that applies the shares; it returns the RAM-tier bytes."""

    def apply() -> int:
        ram = sum(cache.limit_ram(ram_share) for cache in caches_of(engine.prompt_cache))
        generator = engine.generator
        if generator is not None:
            generator.states.limit_live(live_share, keep_newest=keep_newest)
        if ram_share < 1.0:
            _release_mlx_memory()
        return ram

    return apply


def _release_mlx_memory() -> None:
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # MLX missing or not initialised: nothing to release
        pass
