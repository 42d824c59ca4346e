"""Several models in one server: loaded on first use, unloaded when idle, swapped when memory
is short. Each loaded model has its own engine (thread, batch, prompt-cache namespace).

* **On demand.** A request names its model (or an alias); the first request for a model that
  is not loaded waits while it loads (the log and /health say so). Requests for loaded models
  are not held up by the load.
* **Keep-alive.** A model idle (no request queued or running) for longer than its keep-alive is
  unloaded; its conversations stay in its prompt cache on disk (each request's end state is
  checkpointed as it finishes), so the next request after a reload restores them instead of
  prefilling. 0 keeps it loaded; pinned models stay too.
* **Room.** At most `max_loaded` models are resident, and their estimated memory (weights plus
  their KV budget) stays within `memory_budget`. Loading one more first unloads the least
  recently used unpinned model, after its running requests end (drain, then swap). A model that
  could not fit even alone is refused with `ModelTooLarge`.

Engines come from `start_engine(spec)`, a callable of the server's (cli.serve), which also
resolves the model; the pool only decides when. All methods run on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlx_kvserve.engine import Engine
from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.specs import DEFAULT_KEEP_ALIVE, ModelSpec
from mlx_kvserve.vision.family import vision_family

log = logging.getLogger("mlx_kvserve.models")

UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"
LOAD_RETRY = 30.0  # seconds before a model whose load failed is tried again
UNLOAD_RECHECK = 0.5  # seconds between looks at a draining engine's own queue


class ModelTooLarge(Exception):
    """The model's estimated memory exceeds the whole budget."""


class ModelLoadFailed(Exception):
    """The model could not be loaded (its message says why)."""


@dataclass
class Slot:
    """One configured model and, while loaded, its engine."""

    spec: ModelSpec
    model_id: str  # the resolved id (what responses' `model` names by default)
    footprint: int  # estimated bytes when loaded: weights plus KV budget
    state: str = UNLOADED
    engine: Engine | None = None
    last_used: float = 0.0
    loaded_at: float = 0.0
    leases: int = 0  # requests routed to it that have not ended yet
    error: str | None = None
    failed_at: float | None = None  # when its last load failed (retried after LOAD_RETRY)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    loading: asyncio.Future[None] | None = None  # its load, while one runs
    model_dir: Path | None = None  # its files (None: an engine made elsewhere, as in tests)
    # Seconds idle before unloading as the last request asked (Ollama's `keep_alive`: 0 unloads
    # once idle, math.inf never); None: the configured keep-alive.
    requested_keep_alive: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name or self.model_id

    @property
    def names(self) -> list[str]:
        return self.spec.names(self.model_id)

    @property
    def sees_images(self) -> bool:
        """Whether the model takes images: once loaded, whether its engine has a vision tower;
        before, whether its files are a vision checkpoint whose tower runs here (so the API
        knows before a load). Any other model is shown a note in an image's place
        (images/note.py)."""
        engine = self.engine
        if engine is not None and engine.ready.is_set():
            return getattr(engine, "vision", None) is not None
        return vision_family(self.model_dir) is not None

    def busy(self) -> bool:
        engine = self.engine
        engine_busy = engine is not None and (engine.running or engine.queued)
        return bool(self.leases or engine_busy)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class ModelPool:
    def __init__(
        self,
        slots: list[Slot],
        start_engine: Callable[[Slot], Engine],
        *,
        memory_budget: int,
        max_loaded: int,
        keep_alive: float = DEFAULT_KEEP_ALIVE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not slots:
            raise ValueError("a pool needs at least one model")
        self.slots = slots
        self._start_engine = start_engine
        self.memory_budget = memory_budget
        self.max_loaded = max(1, max_loaded)
        self.keep_alive = keep_alive
        self._clock = clock
        self._by_name: dict[str, Slot] = {}
        for slot in slots:
            for name in slot.names:
                self._by_name.setdefault(name, slot)
        self._room = asyncio.Lock()  # one load (and its evictions) at a time
        # hooks: an engine made (before it starts: observers), a model loaded, one unloaded
        self.on_engine: list[Callable[[Slot, Engine], None]] = []
        self.on_loaded: list[Callable[[Slot], None]] = []
        self.on_unloaded: list[Callable[[Slot, str], None]] = []
        # makes the slot of a model fetched while serving, from its id, files and other names
        # (cli.serve sets it: Engines.adopt); None: this pool serves the models it started with
        self.adopt: Callable[[str, Path, tuple[str, ...]], Slot] | None = None

    @classmethod
    def single(cls, engine: Engine, model_id: str, *, aliases: tuple[str, ...] = ()) -> ModelPool:
        """A pool of one model whose engine is already made (not started), kept loaded."""
        slot = Slot(ModelSpec(None, None, aliases, pinned=True), model_id, footprint=0)
        made = [engine]

        def start(_slot: Slot) -> Engine:
            if not made:  # it failed to load: an engine runs once
                raise ModelLoadFailed(engine.load_error or "the model's engine stopped")
            return made.pop()

        return cls([slot], start, memory_budget=1, max_loaded=1, keep_alive=0)

    @property
    def default(self) -> Slot:
        return self.slots[0]

    def find(self, name: str | None) -> Slot | None:
        """The slot a request's model name selects (None: the default model's)."""
        return self.default if name is None else self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def add(self, slot: Slot) -> None:
        """Serve one more model (loaded on first use, as the others); a name already taken
        stays with its model."""
        self.slots.append(slot)
        for name in slot.names:
            self._by_name.setdefault(name, slot)

    def loaded(self) -> list[Slot]:
        return [s for s in self.slots if s.state in (LOADED, LOADING)]

    def engines(self) -> list[Engine]:
        """The engines serving now (loaded, or draining before an unload)."""
        return [s.engine for s in self.slots if s.engine is not None and s.engine.ready.is_set()]

    # -- leases: a request holds one from routing until its stream ends -------------------------
    async def acquire(self, slot: Slot) -> Engine:
        """The slot's engine, loading the model first if needed; the caller must `release`."""
        slot.leases += 1
        try:
            while slot.state != LOADED:
                if slot.state == UNLOADED:
                    await self._load(slot)
                else:  # loading, or unloading (then it loads again)
                    await slot.changed.wait()
                if slot.state == UNLOADED and slot.error:
                    raise ModelLoadFailed(slot.error)
        except BaseException:
            slot.leases -= 1
            raise
        slot.last_used = self._clock()
        assert slot.engine is not None  # loaded: its engine is set
        return slot.engine

    def keep_alive_of(self, slot: Slot) -> float:
        """Seconds idle before `slot` is unloaded; math.inf: never (pinned, or asked so)."""
        if slot.spec.pinned:
            return math.inf
        if slot.requested_keep_alive is not None:
            return slot.requested_keep_alive
        keep = slot.spec.keep_alive if slot.spec.keep_alive is not None else self.keep_alive
        return keep or math.inf  # configured 0: kept loaded for good

    def release(self, slot: Slot) -> None:
        slot.leases = max(0, slot.leases - 1)
        slot.last_used = self._clock()
        if slot.state == UNLOADING and not slot.leases:
            slot._notify()  # an unload waiting for its requests may go on

    # -- loading and unloading ------------------------------------------------------------------
    async def _load(self, slot: Slot) -> None:
        """Load `slot`'s model, or wait for the load under way. The load itself runs to its end
        whoever waits for it (a client that leaves does not leave a model half loaded); making
        the engine (opening its prompt cache: a directory scan) and loading the weights run off
        the event loop, so /health and other streams go on meanwhile."""
        if slot.loading is None:
            slot.loading = asyncio.ensure_future(self._load_now(slot))
            slot.loading.add_done_callback(lambda done: _loaded(slot, done))
        await asyncio.shield(slot.loading)

    async def _load_now(self, slot: Slot) -> None:
        if slot.footprint > self.memory_budget:
            raise ModelTooLarge(
                f"the model {slot.name!r} needs about {slot.footprint / 2**30:.1f} GiB (weights "
                f"and KV budget), more than the {self.memory_budget / 2**30:.1f} GiB this server "
                "may use for models (--memory-budget)"
            )
        async with self._room:
            if slot.state != UNLOADED:
                return
            if slot.failed_at is not None and self._clock() - slot.failed_at < LOAD_RETRY:
                raise ModelLoadFailed(slot.error or "it failed to load")
            slot.error = slot.failed_at = None
            await self._make_room(slot)
            slot.state = LOADING
            slot._notify()
            log.info("loading model %s", slot.name)
            started = self._clock()
            try:
                engine = await asyncio.to_thread(self._start_engine, slot)
                slot.engine = engine  # visible while it loads
                for hook in self.on_engine:
                    hook(slot, engine)
                engine.start()
                await asyncio.to_thread(_wait_loaded, engine)
                if not engine.ready.is_set():
                    await engine.stop_async()
                    raise ModelLoadFailed(engine.load_error or "the engine stopped while loading")
            except Exception as exc:
                slot.state, slot.engine, slot.error = UNLOADED, None, str(exc)
                slot.failed_at = self._clock()
                log.error("could not load model %s: %s", slot.name, exc)
                slot._notify()
                raise ModelLoadFailed(str(exc)) from None
            slot.state = LOADED
            slot.loaded_at = slot.last_used = self._clock()
            log.info("model %s loaded in %.1f s", slot.name, slot.loaded_at - started)
            for loaded in self.on_loaded:
                loaded(slot)
            slot._notify()

    async def _make_room(self, coming: Slot) -> None:
        """Unload least recently used unpinned models until `coming` fits; wait for busy ones
        to drain (they keep serving meanwhile)."""
        while True:
            resident = [s for s in self.slots if s.state in (LOADED, LOADING) and s is not coming]
            used = sum(s.footprint for s in resident)
            if len(resident) < self.max_loaded and used + coming.footprint <= self.memory_budget:
                return
            victims = sorted((s for s in resident if not s.spec.pinned), key=lambda s: s.last_used)
            if not victims:
                raise ModelTooLarge(
                    f"no room for the model {coming.name!r}: the loaded models are pinned "
                    "(unpin one, raise --max-loaded-models or --memory-budget)"
                )
            await self.unload(victims[0], "room", f"to make room for {coming.name}")

    async def unload(self, slot: Slot, kind: str, reason: str = "") -> bool:
        """Drain the model's requests, then stop its engine. Nothing of its conversations is
        lost: each request's end state is checkpointed as it finishes ("generation"), and
        stopping flushes the pending checkpoint writes to disk."""
        if slot.state != LOADED or slot.engine is None or not slot.engine.unloadable:
            return False  # a job's model: its ranks would stop with it (cli/serve_job.py)
        slot.state = UNLOADING  # new requests for it wait for the reload
        slot._notify()
        reason = reason or kind
        log.info("unloading model %s (%s): waiting for its requests to end", slot.name, reason)
        while slot.busy():
            # a request's release wakes this at once; the engine's own queue (requests it
            # still finishes after their clients left) has no event, so look again now and then
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(slot.changed.wait(), UNLOAD_RECHECK)
        engine, slot.engine = slot.engine, None
        await engine.stop_async()
        del engine
        gc.collect()
        _release_mlx_memory()
        slot.state = UNLOADED
        log.info("model %s unloaded (%s)", slot.name, reason)
        for unloaded in self.on_unloaded:
            unloaded(slot, kind)
        slot._notify()
        return True

    async def unload_idle(self) -> list[str]:
        """Unload every model idle past its keep-alive; the names unloaded."""
        now, done = self._clock(), []
        for slot in self.slots:
            keep = self.keep_alive_of(slot)
            if slot.state != LOADED or keep == math.inf or slot.busy():
                continue
            idle = now - slot.last_used
            if idle >= keep and await self.unload(slot, "idle", f"idle for {idle:.0f} s"):
                done.append(slot.name)
        return done

    async def run_reaper(self, every: float = 1.0) -> None:
        """The keep-alive loop (a task for the app's lifetime)."""
        while True:
            await asyncio.sleep(every)
            try:
                await self.unload_idle()
            except Exception:
                log.exception("keep-alive check failed")

    def drain(self, grace: float) -> None:
        """Graceful shutdown: every engine refuses new work and ends its streams after `grace`."""
        for engine in self.engines():
            engine.drain(grace)

    async def close(self) -> None:
        for slot in self.slots:
            if slot.engine is not None:
                await slot.engine.stop_async()
                slot.engine, slot.state = None, UNLOADED

    def describe(self) -> list[dict[str, JSON]]:
        """Every model, as /v1/models, `ps` and the status page show them."""
        now = self._clock()
        return [
            {
                "name": s.name,
                "id": s.model_id,
                "aliases": [n for n in s.names if n != s.name],
                "default": s is self.default,
                "state": s.state,
                "loaded": s.state == LOADED,
                "pinned": s.spec.pinned,
                "footprint_bytes": s.footprint,
                "idle_seconds": None if s.state != LOADED or s.busy() else now - s.last_used,
                # 0: never unloaded for idleness
                "keep_alive_seconds": 0 if (k := self.keep_alive_of(s)) == math.inf else k,
                "error": s.error or (s.engine.failure if s.engine is not None else None),
            }
            for s in self.slots
        ]


def _loaded(slot: Slot, load: asyncio.Future[None]) -> None:
    """A load ended: the next one is a new one (its error was raised to whoever waited)."""
    slot.loading = None
    if not load.cancelled():
        load.exception()  # retrieved: nobody may be waiting any more


def _wait_loaded(engine: Engine) -> None:
    """Until the engine is ready, or its thread ended without being ready (a load error)."""
    while not engine.ready.wait(0.1):
        if engine.load_error:
            return


def _release_mlx_memory() -> None:
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # MLX missing or not initialised: nothing to release
        pass
