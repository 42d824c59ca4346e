"""Embedding requests, shared by OpenAI's `/v1/embeddings` (api/openai_embeddings.py) and
Ollama's `/api/embed` and `/api/embeddings` (api/ollama_embed.py).

The inputs are tokenized off the event loop, checked (none empty, none longer than the model's
context unless the protocol truncates, every token id in the vocabulary), queued on the model's
`Embedder` (embed/batcher.py: batched with other requests' inputs, on the engine thread between
generation's steps) and awaited; a client that disconnects meanwhile drops its inputs not yet
computed. The vectors come back pooled and not normalised: each protocol normalises as it does.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from mlx_kvserve.api.disconnect import unless_gone
from mlx_kvserve.api.engine_view import EngineView
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import acquire_model, unavailable
from mlx_kvserve.embed.batcher import Embedder
from mlx_kvserve.embed.kind import kind_of
from mlx_kvserve.embed.pooling import NoHiddenStates, hidden_width
from mlx_kvserve.engine import EngineNotReady
from mlx_kvserve.models.pool import ModelPool, Slot
from mlx_kvserve.vocabulary import unknown_token_id

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request

Input = str | list[int]


@dataclass(frozen=True)
class Embedded:
    """The pooled vectors (float32, in the inputs' order), the tokens read, and timings."""

    vectors: list[np.ndarray]
    tokens: int
    load_seconds: float
    total_seconds: float


_embedders: weakref.WeakKeyDictionary[EngineView, Embedder] = weakref.WeakKeyDictionary()


def embedder_for(request: Request, engine: EngineView, slot: Slot) -> Embedder:
    """The model's embedding queue, made once per loaded engine."""
    embedder = _embedders.get(engine)
    if embedder is None:
        counted = request.app.state.metrics.embedding_inputs
        embedder = _embedders[engine] = Embedder(
            engine,
            kind_of(slot.model_dir).pooling,
            count=lambda outcome, n: counted.labels(outcome).inc(n),
        )
    return embedder


async def embed(
    request: Request,
    slot: Slot,
    inputs: list[Input],
    *,
    field: str,
    truncate: bool = False,
    dimensions: int | None = None,
    limit: int | None = None,
) -> Embedded | None:
    """Embed `inputs` on `slot`'s model (None: the client left before the answer). `field`
    names the inputs in errors; `truncate` cuts inputs longer than the context (or `limit`,
    if smaller) instead of refusing them (Ollama's default)."""
    started = time.perf_counter()
    if len(inputs) > MAX_INPUTS:
        raise APIError(
            400, f"at most {MAX_INPUTS} inputs per request (got {len(inputs)})", param=field
        )
    pool: ModelPool = request.app.state.pool
    engine = await acquire_model(request, slot)
    try:
        loaded = time.perf_counter()
        if engine.cluster is not None:
            raise APIError(
                501,
                "embeddings are not served by a job across machines: each rank holds part of "
                "the model; serve the embedding model from one machine",
                param="model",
            )
        width = hidden_width(engine.model)
        _check_dimensions(dimensions, width)
        window = engine.context_length
        if limit is not None:
            window = limit if window is None else min(window, limit)
        rows = await run_in_threadpool(tokenized, engine, inputs, field, truncate, window)
        job = embedder_for(request, engine, slot).submit(rows)
        try:
            vectors = await unless_gone(request, job, job.done)
            if vectors is None:
                return None
        except EngineNotReady as exc:
            raise unavailable(str(exc)) from None
        except NoHiddenStates as exc:
            raise APIError(
                400, f"the model {slot.name!r} cannot embed: {exc}", param="model"
            ) from None
    finally:
        pool.release(slot)
    if vectors:
        _check_dimensions(dimensions, int(vectors[0].shape[0]))
    return Embedded(
        vectors,
        sum(len(row) for row in rows),
        loaded - started,
        time.perf_counter() - started,
    )


def _check_dimensions(dimensions: int | None, width: int | None) -> None:
    if dimensions is None or width is None:
        return
    if dimensions > width:
        raise APIError(
            400,
            f"dimensions {dimensions} is above the model's embedding width ({width})",
            param="dimensions",
        )


def tokenized(
    engine: EngineView,
    inputs: list[Input],
    field: str,
    truncate: bool,
    context: int | None,
    purpose: str = "embed",
) -> list[list[int]]:
    """Each input's token ids (a text through the tokenizer, as the model card's code does:
    its special tokens included), checked: a 400 naming the input for an unknown id, nothing to
    `purpose`, or more tokens than `context` (unless `truncate`). The scored prompts of
    api/text_echo.py are read the same way."""
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    rows: list[list[int]] = []
    for i, value in enumerate(inputs):
        where = f"{field}[{i}]" if len(inputs) > 1 else field
        if isinstance(value, str):
            # (an empty text is refused even where the tokenizer would add a BOS to it)
            row = list(tokenizer.encode(value)) if value else []
        else:
            unknown = unknown_token_id(tokenizer, value)
            if unknown is not None:
                bad, size = unknown
                raise APIError(
                    400,
                    f"{where}: token id {bad} is outside the vocabulary (0 to {size - 1})",
                    param=where,
                )
            row = list(value)
        if not row:
            raise APIError(400, f"{where} is empty: there is nothing to {purpose}", param=where)
        if context is not None and len(row) > context:
            if not truncate:
                raise APIError(
                    400,
                    f"{where} is {len(row)} tokens, longer than the model's context "
                    f"({context} tokens)",
                    param=where,
                    code="context_length_exceeded",
                )
            row = row[:context]
        rows.append(row)
    return rows
