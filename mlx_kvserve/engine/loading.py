"""Loading the model on the engine thread: what the engine learns about it, what it makes to
serve it, and what it says about it. ENGINE THREAD.

What a loader gives the engine (`Loaded`), the context window (models/context.py), the
per-layer cache description (cache/kinds.py) and the warnings a user needs when either is
incomplete; what serves the model, made by `Loading._load` (a mixin of `Engine`, kept apart
from the serving loop in engine/worker.py because it runs once, before it); then the one line
that says the model is ready and how much KV memory it may use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_kvserve.cache.kinds import KVLayout, describe_model
from mlx_kvserve.engine.batch import DecodeBatch, can_batch
from mlx_kvserve.engine.generate import Generator
from mlx_kvserve.engine.image_prefill import VisionRows
from mlx_kvserve.engine.ledger import KVCost
from mlx_kvserve.engine.live import Timings
from mlx_kvserve.engine.lockstep import Agreement
from mlx_kvserve.engine.memory import MemoryPolicy
from mlx_kvserve.engine.merge_check import merged_decoding_agrees
from mlx_kvserve.engine.namespaces import Caches, CacheSet, by_namespace, make_states
from mlx_kvserve.engine.protocols import PromptCacheView
from mlx_kvserve.engine.requests import GenerationRequest
from mlx_kvserve.engine.room import Room
from mlx_kvserve.engine.sequence import Sequence
from mlx_kvserve.engine.speculation.continuations import Continuations
from mlx_kvserve.engine.speculation.draft_model import DraftLoader, load_draft
from mlx_kvserve.engine.speculation.mtp import Tap
from mlx_kvserve.models.context import context_from_model
from mlx_kvserve.models.mtp_heads import MTPHeads

log = logging.getLogger("mlx_kvserve.engine")


class Loaded(NamedTuple):
    """What an engine's loader returns: the model and its tokenizer, as `mlx_lm.load` does,
    and the prompt cache to use instead of the one the engine was made with when the dtype
    the model is served in names another (`--kv-dtype auto`; the loader closed the other), and
    a vision model's tower."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    prompt_cache: Caches = None
    mtp: MTPHeads | None = None  # the checkpoint's MTP heads, a draft source (--speculation)
    vision: VisionRows | None = None  # a vision model's tower (vision/encoder.py)


# Runs on the engine thread: `Loaded`, or mlx_lm.load's (model, tokenizer) pair.
Loader = Callable[[], Loaded | tuple[nn.Module, TokenizerWrapper]]

# Makes the agreement of the job an engine steps with across machines, once its model is
# loaded, from the prompt cache it checkpoints to (engine/lockstep.py: `Lockstep`).
MakeAgreement = Callable[[PromptCacheView | None], Agreement]


def describe_loaded(model: nn.Module, context_length: int | None) -> tuple[int | None, KVLayout]:
    """(the context window, the model's cache layout), with a warning for each gap."""
    if context_length is None:
        context_length = context_from_model(model)
    if context_length is None:
        log.warning(
            "the model's config states no context length: prompts are not checked "
            "against a window and requests without max_tokens get the default cap"
        )
    layout = describe_model(model)
    if layout.unknown:
        log.warning(
            "cache class(es) %s unknown to mlx-kvserve: their state is checkpointed "
            "whole (snapshots) and requests run one at a time",
            ", ".join(layout.unknown),
        )
    if layout.unrestorable:
        log.warning(
            "prompt cache off for this model: cache class(es) %s keep a state that cannot be "
            "set back (a read-only `state`), so no checkpoint of it could be restored",
            ", ".join(layout.unrestorable),
        )
    return context_length, layout


class Loading:
    """`_load` for `Engine`, which defines the attributes used."""

    _loader: Loader
    _job: MakeAgreement | None
    _draft_loader: DraftLoader | None
    _can_batch: bool
    _ended: Callable[[Sequence], None]
    _same_pass: Callable[[list[int]], None]  # a job's decode pass, alike on every rank
    _observe: Callable[[GenerationRequest, Timings | None], None]
    prompt_cache: Caches
    cache_enabled: bool
    prefill_step: int
    checkpoint_interval: int
    live_budget: int
    kv_budget: int | None
    kv_reserve: int
    speculation: str
    model: nn.Module | None
    tokenizer: TokenizerWrapper | None
    vision: VisionRows | None
    context_length: int | None
    layout: KVLayout | None
    lockstep: Agreement
    memory: MemoryPolicy
    generator: Generator | None
    room: Room | None
    batch: DecodeBatch | None
    continuations: Continuations | None

    def _load(self) -> None:
        """Load the model and make what serves it: its prompt states, generator, KV ledger and
        decode batch (and, in a job, the job's agreement: its ranks agree on what their shards
        of the model can do)."""
        loaded = Loaded(*self._loader())
        model, tokenizer, prompt_cache = loaded.model, loaded.tokenizer, loaded.prompt_cache
        self.vision = loaded.vision
        if prompt_cache is not None:
            self.prompt_cache = prompt_cache
        self.model, self.tokenizer = model, tokenizer
        self.context_length, self.layout = describe_loaded(model, self.context_length)
        # A model whose caches cannot take a state back keeps its resident sessions but
        # stores no checkpoint (see `describe_loaded`).
        checkpoints_to = None if self.layout.unrestorable else self.prompt_cache
        if self._job is not None:
            assert not isinstance(checkpoints_to, CacheSet), "no per-key caches across ranks"
            self.lockstep = self._job(checkpoints_to)
        job = self.lockstep if self.lockstep.distributed else None
        states = make_states(
            model, checkpoints_to, enabled=self.cache_enabled, live_budget=self.live_budget, job=job
        )
        if self.vision is not None:
            self.vision.keep_in(states.features)
        # Across machines every rank would have to run the check's passes in step: a job
        # trusts the layout alone (engine/merge_check.py).
        merges = can_batch(self.layout) and (job is not None or merged_decoding_agrees(model))
        self._can_batch = self.lockstep.all_true(merges, "batching")
        speculation = self.speculation  # in a job, rank 0 weighs every rank's drafts (job.py)
        if job is not None:  # and only if every rank's settings ask for it
            auto = job.all_true(speculation == "auto", "speculation")
            speculation = "auto" if auto else "off"
        mtp = loaded.mtp if speculation == "auto" and job is None else None
        tap = Tap(model, mtp) if mtp is not None else None  # the prefill's hidden states too
        self.generator = Generator(
            tap or model,
            tokenizer,
            states,
            prefill_step=self.prefill_step,
            checkpoint_interval=self.checkpoint_interval,
            sliceable=self.lockstep.all_true(self.layout.sliceable, "slicing"),
            after_prefill=self.memory.after_prefill,
            before_done=self._observe,
            vision=self.vision,
        )
        self.memory.start(model)
        if self.kv_budget is None:
            self.kv_budget = self.memory.default_kv_budget(model)
        if job is not None and self._draft_loader is not None:
            log.warning("a job across machines drafts without its draft model (not loaded)")
        loader = self._draft_loader if job is None else None  # each rank's own passes: job.py
        drafts = load_draft(loader, model, tokenizer, self.prefill_step, speculation)
        layers = self.layout.layers + (describe_model(drafts.model).layers if drafts else ())
        self.room = Room(
            layers,  # a draft model's KV is counted per row beside the model's
            self.kv_budget,
            states,
            checkpoints_to,
            self.kv_reserve,
            batched=self._can_batch,
        )
        if speculation == "auto":  # a draft source: what finished requests' tokens went on with
            # 3 tokens at least: a 2-token match among many documents is common in prose and
            # seldom right (docs/speculation.md, the benchmark's prose cell)
            self.continuations = Continuations(n_min=3)
            # and stored entries' (not in a job: each rank's disk cache is its own)
            for namespace, cache in by_namespace(self.prompt_cache) if job is None else []:
                for tokens in cache.token_streams(self.continuations.max_tokens):
                    self.continuations.remember(namespace, tokens)
        self.batch = DecodeBatch(
            tap or model,
            self._ended,
            mergeable=self._can_batch,
            speculation=speculation,
            continuations=self.continuations,
            mtp=mtp,
            draft_model=drafts,
            job=None if job is None else self._same_pass,
        )


def log_ready(
    context_length: int | None, layout: KVLayout, concurrency: int, batched: bool, budget: int
) -> None:
    cost = KVCost.of(layout.layers)
    log.info(
        "model ready (context %s tokens; layers: %s; up to %d requests decode together%s; "
        "KV budget %.1f GiB, %d bytes per token + %d per sequence: %d tokens fit)",
        context_length,
        layout.summary(),
        concurrency if batched else 1,
        "" if batched else ": this model's caches cannot be batched",
        budget / 2**30,
        layout.bytes_per_token,
        layout.fixed_bytes,
        cost.tokens_within(budget),
    )
