"""What the engine learns about a model once it is loaded, and what it says about it. ENGINE THREAD.

What a loader gives the engine (`Loaded`), the context window (models/context.py), the
per-layer cache description (cache/kinds.py) and the warnings a user needs when either is
incomplete, then the one line that says the model is ready and how much KV memory it may use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_kvserve.cache.kinds import KVLayout, describe_model
from mlx_kvserve.engine.image_prefill import VisionRows
from mlx_kvserve.engine.ledger import KVCost
from mlx_kvserve.engine.namespaces import Caches
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
