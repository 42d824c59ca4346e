"""`mlx-kvserve serve` on every rank of an `mlx.launch` job: one model split across machines.

Every rank prepares the same model from its own disk, joins the job (distributed/join.py: the
same files on every rank, its shard of the weights, a greedy probe in lockstep) and runs an
engine that steps with rank 0's (engine/lockstep.py). Only rank 0 opens HTTP, and only once
every rank has joined: a job that cannot serve says why on every rank and exits 2 before any
port opens. The other ranks run until rank 0 stops them (its SIGTERM drains, then every engine
stops at the same turn); a rank that dies or hangs ends the job (exit 75) within
`--peer-timeout` seconds (a forward pass: `engine.lockstep.pass_timeout`), for the service
manager to restart every rank. A rank > 0 whose engine failed exits 70 with the cause.

Each rank keeps its own slice of every checkpoint in a prompt cache of its own, named by the
model's fingerprint, the split, the world size and the rank (a directory written by another
job layout is another cache); where a prefill starts is agreed by every rank
(engine/job_states.py). Not yet across ranks: several models, per-key caches.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mlx_kvserve.config.settings import Settings
from mlx_kvserve.distributed.collective import Collective
from mlx_kvserve.distributed.join import JoinedModel
from mlx_kvserve.engine import Engine
from mlx_kvserve.engine.loading import Loaded
from mlx_kvserve.engine.lockstep import Agreement, Lockstep
from mlx_kvserve.engine.namespaces import Caches
from mlx_kvserve.engine.protocols import PromptCacheView
from mlx_kvserve.models.pool import ModelPool

log = logging.getLogger("mlx_kvserve")

EXIT_ENGINE_DIED = 70  # EX_SOFTWARE: this rank's engine failed; rank 0 then exits 75 (peer lost)


class OpenPromptCache(Protocol):
    """cli/serve.py's `open_prompt_cache`: the model's prompt cache (None with --no-cache);
    `rank` names this rank's slice of it."""

    def __call__(
        self,
        settings: Settings,
        model_dir: Path,
        model_id: str,
        kv_dtype: str | None = None,
        rank: str | None = None,
    ) -> Caches: ...


@dataclass(frozen=True)
class ServeParts:
    """What `serve` lends a rank: its prompt-cache opener, its HTTP server, its way to exit."""

    open_prompt_cache: OpenPromptCache
    run_http: Callable[[Settings, ModelPool], None]
    exit_now: Callable[[int], None]


def serve_job(settings: Settings, collective: Collective, parts: ServeParts) -> int:
    """Serve as one rank of the job until it stops; ends the process with its exit code."""
    parts.exit_now(_serve(settings, collective, parts))
    return 0  # not reached


def _serve(settings: Settings, collective: Collective, parts: ServeParts) -> int:
    from mlx_kvserve.cache import CacheLockedError
    from mlx_kvserve.models.serving import ModelSetupError, prepare_slots

    rank = f"rank {collective.rank}/{collective.size}"
    if not collective.is_leader:  # rank 0 logs each request; the others, what goes wrong
        logging.getLogger("mlx_kvserve.engine").setLevel(logging.WARNING)
    joined: dict[str, JoinedModel] = {}
    shard = None if settings.shard == "auto" else settings.shard  # None: the model's best

    def load(path: str) -> Loaded:
        from mlx_kvserve.distributed.join import JoinError, join_model
        from mlx_kvserve.distributed.sharding import ShardingError

        try:
            job = join_model(collective, Path(path), shard)
        except (JoinError, ShardingError) as exc:  # alike on every rank
            log.error("%s: %s", rank, exc)
            collective.barrier("refusal")  # every rank says why before mlx.launch ends them
            raise
        joined["job"] = job
        return Loaded(job.model, job.tokenizer)

    problem = None
    if not collective.is_leader:
        collective.barrier("model files")  # rank 0 prepares first (an embedded model unpacks)

    def open_cache(
        settings: Settings, model_dir: Path, model_id: str, kv_dtype: str | None = None
    ) -> Caches:
        """This rank's slices of the checkpoints: a job of another split or size is another
        cache (a split the model cannot take is refused when the ranks join)."""
        from mlx_kvserve.distributed.sharding import ShardingError, plan_for_directory

        try:
            mode = plan_for_directory(model_dir, collective.size, shard)
        except ShardingError:
            mode = settings.shard
        name = f"{mode}-{collective.size}r{collective.rank}"
        return parts.open_prompt_cache(settings, model_dir, model_id, kv_dtype, rank=name)

    def agreement(cache: PromptCacheView | None) -> Agreement:
        """The engine's side of the job, made once its model is loaded (and joined)."""
        job = joined["job"]
        cluster = {
            "ranks": collective.size,
            "hosts": job.hosts,
            "shard": job.plan.mode,
            "fingerprint": job.fingerprint,
        }
        return _lockstep(collective, job, cache, cluster)

    try:
        slots, start_engine = prepare_slots(settings, open_cache, load, agreement)
        if len(slots) > 1:
            problem = "a job across machines serves one model; give one --model"
        elif settings.isolate_cache:
            problem = "--isolate-cache is not available across machines yet"
        else:
            engine = start_engine(slots[0])  # its prompt cache opens now
    except (ModelSetupError, CacheLockedError) as exc:
        problem = str(exc)
    if collective.is_leader:
        collective.barrier("model files")
    problems = collective.gather(problem, "model files")
    if any(problems):
        first = next(i for i, p in enumerate(problems) if p)
        log.error("%s: cannot serve: rank %d: %s", rank, first, problems[first])
        collective.barrier("refusal")
        return 2

    engine.start()  # not unloadable: stopping it stops the job
    while not engine.ready.wait(0.2):
        if engine.load_error:
            return 2  # said on every rank by `load`, or this rank's own files (logged)
    job = joined["job"]
    if not collective.is_leader:
        return _follow(engine, rank)
    log.info(
        "job of %d ranks on %s: %s parallel; rank 0 serves HTTP",
        collective.size,
        ", ".join(job.hosts),
        job.plan.mode,
    )
    from mlx_kvserve.distributed.launcher import note_rank_0, warn_public_ring

    note_rank_0(collective.rank)  # for `serve --hostfile`, which stops the job through rank 0
    warn_public_ring()

    slot = slots[0]  # loaded for good: its weights are spread over the job's ranks
    slot.spec = dataclasses.replace(slot.spec, pinned=True)
    pool = ModelPool(
        [slot], lambda _slot: engine, memory_budget=max(1, slot.footprint), max_loaded=1
    )
    parts.run_http(settings, pool)
    return 0


def _lockstep(
    collective: Collective, job: JoinedModel, cache: PromptCacheView | None, cluster: dict
) -> Lockstep:
    from mlx_kvserve.chat.grammar import GrammarCompiler
    from mlx_kvserve.distributed.request_wire import RequestWire

    compilers: list[GrammarCompiler] = []

    def compiler() -> GrammarCompiler:
        if not compilers:
            compilers.append(GrammarCompiler(job.tokenizer))
        return compilers[0]

    return Lockstep(collective, RequestWire(compiler), cache=cache, cluster=cluster)


def _follow(engine: Engine, rank: str) -> int:
    """A rank > 0: step with rank 0 until it stops the job; signals are rank 0's to act on."""

    def note(signum: int, _frame: object) -> None:
        log.info("%s: signal %d: this rank stops when rank 0 stops the job", rank, signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, note)
    log.info("%s: ready, stepping with rank 0", rank)
    engine.join()
    engine.stop()  # the engine thread has ended: this flushes the cache's writes
    if engine.failure is not None:  # not at rank 0's order: mlx.launch ends the others
        log.critical("%s: the engine stopped on its own: %s", rank, engine.failure)
        return EXIT_ENGINE_DIED
    log.info("%s: stopped with rank 0", rank)
    return 0


__all__ = ["serve_job"]
