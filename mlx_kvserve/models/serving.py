"""From settings to servable models: resolve every configured model at start-up (so a typo is
an exit at start, not a 503 an hour later), and make each model's engine when the pool loads it.

Per-model settings (`[[models]] settings = {...}`) override the server's for that model's
engine and prompt cache: the keys in `PER_MODEL`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_kvserve import paths
from mlx_kvserve.config.settings import Settings
from mlx_kvserve.config.values import check_value, parse_size
from mlx_kvserve.engine import Engine
from mlx_kvserve.engine.loading import Loaded, MakeAgreement
from mlx_kvserve.engine.namespaces import Caches
from mlx_kvserve.models.budget import footprint, weights_bytes
from mlx_kvserve.models.pool import Slot
from mlx_kvserve.models.specs import ModelSpec

log = logging.getLogger("mlx_kvserve")

# cli/serve.py's `open_prompt_cache(settings, model_dir, model_id, kv_dtype)`: the model's
# prompt cache for the dtype it is served in (None with --no-cache).
OpenCache = Callable[[Settings, Path, str, str | None], Caches]

PER_MODEL = frozenset(
    {
        "kv_dtype",
        "kv_budget",
        "live_budget",
        "prefill_step",
        "checkpoint_interval",
        "max_concurrency",
        "max_queue",
        "speculation",
        "mtp",
        "draft_model",
        "cache_budget",
        "cache_ram_budget",
        "no_cache",
    }
)


class ModelSetupError(Exception):
    """A configured model cannot be served; the message says which and why."""


def model_settings(settings: Settings, spec: ModelSpec) -> Settings:
    """The server's settings with the model's own overrides."""
    unknown = set(spec.settings) - PER_MODEL
    if unknown:
        raise ModelSetupError(
            f"model {spec.name or spec.source}: settings {sorted(unknown)} cannot be set per "
            f"model (these can: {', '.join(sorted(PER_MODEL))})"
        )
    try:
        for key, value in spec.settings.items():
            check_value(key, value)
        return dataclasses.replace(settings, **dict(spec.settings))
    except (ValueError, TypeError) as exc:
        raise ModelSetupError(f"model {spec.name or spec.source}: {exc}") from None


class Engines:
    """Each slot's engine maker: the models configured at start, and those added while serving
    (Ollama's `/api/pull`: `adopt`)."""

    def __init__(
        self,
        settings: Settings,
        open_prompt_cache: OpenCache,
        mlx_load: Callable[[str], Loaded | tuple[nn.Module, TokenizerWrapper]],
        job: MakeAgreement | None = None,
    ) -> None:
        self.settings = settings
        self._open_prompt_cache = open_prompt_cache
        self._mlx_load = mlx_load
        self._job = job
        self._places: dict[str, tuple[Path, Settings, Path | None]] = {}

    def slot(self, spec: ModelSpec, model_id: str, model_dir: Path) -> Slot:
        """The pool slot of a model whose files are in `model_dir` (ModelSetupError: they
        cannot be served)."""
        from mlx_kvserve.models.preflight import model_dir_problem

        problem = model_dir_problem(model_dir)
        if problem:
            raise ModelSetupError(f"cannot serve the model {spec.source!r}: {problem}")
        own = model_settings(self.settings, spec)
        if own.mtp == "on":
            from mlx_kvserve.models.mtp_heads import heads_problem

            problem = heads_problem(model_dir, own.speculation)
            if problem:
                raise ModelSetupError(f"--mtp on: cannot draft for {spec.source!r}: {problem}")
        draft_dir = self._draft(spec, own, model_dir)
        kv_reserve = None if own.kv_budget == "auto" else parse_size(own.kv_budget)
        size = footprint(model_dir, kv_reserve) + (weights_bytes(draft_dir) if draft_dir else 0)
        slot = Slot(spec, model_id, size, model_dir=model_dir)
        self._places[slot.name] = (model_dir, own, draft_dir)
        return slot

    def _draft(self, spec: ModelSpec, own: Settings, model_dir: Path) -> Path | None:
        """The model's draft model, checked now (models/draft.py), or None."""
        from mlx_kvserve.models.draft import prepare_draft

        if own.draft_model is None:
            return None
        if own.speculation != "auto":
            log.warning(
                "model %s: draft model %r not loaded: --speculation is %s",
                spec.name or spec.source,
                own.draft_model,
                own.speculation,
            )
            return None
        try:
            return prepare_draft(own.draft_model, model_dir, paths.data_dir())
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelSetupError(f"model {spec.name or spec.source}: {exc}") from None

    def adopt(self, model_id: str, model_dir: Path, aliases: tuple[str, ...] = ()) -> Slot:
        """The slot of a model fetched while serving: named by its id (and `aliases`), with
        the server's settings."""
        spec = ModelSpec(None, model_id, aliases, settings={"draft_model": None})
        return self.slot(spec, model_id, model_dir)  # the server's draft model is another's

    def __call__(self, slot: Slot) -> Engine:
        model_dir, own, draft_dir = self._places[slot.name]
        return make_engine(
            own,
            model_dir,
            slot.model_id,
            self._open_prompt_cache,
            self._mlx_load,
            self._job,
            draft_dir,
        )


def prepare_slots(
    settings: Settings,
    open_prompt_cache: OpenCache,
    mlx_load: Callable[[str], Loaded | tuple[nn.Module, TokenizerWrapper]],
    job: MakeAgreement | None = None,
) -> tuple[list[Slot], Engines]:
    """Every configured model as a pool slot (default first), and the engine maker (`job`:
    how its engine joins a job across machines, cli/serve_job.py)."""
    from mlx_kvserve.models.resolve import local_model_dir, resolve_model

    try:
        specs = settings.model_specs()
    except ValueError as exc:
        raise ModelSetupError(str(exc)) from None
    if settings.draft_model is not None and len(specs) > 1:
        raise ModelSetupError(
            f"--draft-model serves one model, and {len(specs)} are configured: a draft model "
            "needs its model's tokenizer, so set it per model ([[models]] settings = "
            '{draft_model = "..."})'
        )
    engines = Engines(settings, open_prompt_cache, mlx_load, job)
    slots: list[Slot] = []
    taken: dict[str, str] = {}
    for spec in specs:
        try:
            model_id, ref = resolve_model(spec.source, paths.data_dir(), progress=True)
            model_dir = local_model_dir(ref)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelSetupError(f"cannot prepare the model {spec.source!r}: {exc}") from None
        slot = engines.slot(spec, model_id, model_dir)
        for name in slot.names:
            if name in taken:
                raise ModelSetupError(
                    f"the name {name!r} is given to two models ({taken[name]} and "
                    f"{slot.name}); name them apart with --model NAME=PATH"
                )
            taken[name] = slot.name
        slots.append(slot)
    return slots, engines


def make_engine(
    settings: Settings,
    model_dir: Path,
    model_id: str,
    open_prompt_cache: OpenCache,
    mlx_load: Callable[[str], Loaded | tuple[nn.Module, TokenizerWrapper]],
    job: MakeAgreement | None = None,
    draft_dir: Path | None = None,
) -> Engine:
    """One model's engine (not started) with its prompt cache open (`draft_dir`: its draft
    model's files, checked by models/draft.py)."""
    from mlx_kvserve.chat.formats import add_end_tokens, tool_format_notice
    from mlx_kvserve.embed.encoder import EncoderEngine, load_encoder
    from mlx_kvserve.embed.kind import kind_of, pooling_config
    from mlx_kvserve.embed.pooling import ENCODER
    from mlx_kvserve.models.context import read_context_length
    from mlx_kvserve.models.mtp_heads import load_heads
    from mlx_kvserve.models.precision import (
        apply_kv_dtype,
        on_metal,
        resolve_kv_dtype,
        served_dtype,
    )
    from mlx_kvserve.vision.encoder import load_vision

    if kind_of(model_dir).pooling == ENCODER:  # a model that only embeds (embed/encoder.py)
        pooling = pooling_config(model_dir)
        return EncoderEngine(  # type: ignore[return-value]  # the pool's engine, as EngineView
            lambda: load_encoder(model_dir, pooling),
            context_length=read_context_length(model_dir),
            mlx_cache_limit=parse_size(settings.mlx_cache_limit),
        )
    kv_dtype = resolve_kv_dtype(settings.kv_dtype, metal=on_metal())
    prompt_cache = open_prompt_cache(settings, model_dir, model_id, kv_dtype)

    def load_model() -> Loaded:
        model, tokenizer = Loaded(*mlx_load(str(model_dir)))[:2]
        vision = load_vision(model_dir, tokenizer.convert_ids_to_tokens, model)
        add_end_tokens(tokenizer)  # its format's own (gpt-oss's <|call|>) end a generation
        log.info("%s", tool_format_notice(tokenizer))
        cast = apply_kv_dtype(model, kv_dtype, only_if_float32=settings.kv_dtype == "auto")
        if cast:
            log.info("serving the model's activations and KV cache in %s", kv_dtype)
        wanted = settings.speculation == "auto" and settings.mtp != "off"
        mtp = load_heads(model_dir, model) if wanted else None
        if mtp is not None:
            log.info("drafting with the checkpoint's %d MTP layer(s) too", mtp.depth)
        used = served_dtype(settings.kv_dtype, kv_dtype, cast)
        if used == kv_dtype or prompt_cache is None:
            return Loaded(model, tokenizer, mtp=mtp, vision=vision)
        # "auto" left the model in its own dtype: its cache is the one named for that dtype
        prompt_cache.close()
        other = open_prompt_cache(settings, model_dir, model_id, used)
        return Loaded(model, tokenizer, other, mtp, vision)

    def load_draft() -> tuple[nn.Module, TokenizerWrapper]:
        assert draft_dir is not None
        model, tokenizer, *_ = mlx_load(str(draft_dir))
        apply_kv_dtype(model, kv_dtype, only_if_float32=settings.kv_dtype == "auto")
        return model, tokenizer

    return Engine(
        load_model,
        prompt_cache=prompt_cache,
        cache_enabled=not settings.no_cache,
        prefill_step=settings.prefill_step,
        checkpoint_interval=settings.checkpoint_interval,
        mlx_cache_limit=parse_size(settings.mlx_cache_limit),
        max_queue=settings.max_queue,
        max_concurrency=settings.max_concurrency,
        kv_budget=None if settings.kv_budget == "auto" else parse_size(settings.kv_budget),
        live_budget=parse_size(settings.live_budget),
        kv_reserve=settings.kv_reserve,
        speculation=settings.speculation,
        draft_loader=load_draft if draft_dir is not None else None,
        context_length=read_context_length(model_dir),
        job=job,
    )
