"""The engine of a model that only embeds: a bidirectional encoder (BERT's family: all-MiniLM,
bge, e5, nomic-embed-text; `bert`, `xlm-roberta`, `modernbert`) or EmbeddingGemma, loaded with
mlx-vlm's embedding models (MIT; the optional `embeddings` extra).

mlx-lm runs causal models only, and the generation engine (engine/worker.py) builds a
generator, a KV ledger and a decode batch from what it loads; an encoder needs none of them.
This engine is a thread that loads the model, then runs `call()`s, the embedding batches
(embed/batcher.py), one after another. It has no KV, no prompt cache and takes no generation
request: the API answers those with a 400 (`generates` is False).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_kvserve.engine import EngineNotReady, GenerationRequest
from mlx_kvserve.engine.calls import CallQueue
from mlx_kvserve.engine.memory import MemoryPolicy
from mlx_kvserve.json_value import JSON

log = logging.getLogger("mlx_kvserve.embed")
T = TypeVar("T")
# mlx-vlm's embedding model for each config `model_type` it serves (its
# embedding_loader.EMBEDDING_MODEL_REMAPPING; gemma3_text: EmbeddingGemma)
ENCODED = frozenset({"bert", "xlm-roberta", "modernbert", "gemma3_text"})


def encoder_library() -> str | None:
    """Why encoders cannot be served here (None: mlx-vlm's embedding models are installed)."""
    try:
        import mlx_vlm.embedding_loader  # noqa: F401
    except ImportError:
        return "install the embeddings extra (pip install 'mlx-kvserve[embeddings]': mlx-vlm)"
    return None


def load_encoder(
    model_dir: Path, pooling: dict[str, JSON] | None
) -> tuple[nn.Module, TokenizerWrapper]:
    """ENGINE THREAD. The model (pooling as `pooling`, sentence-transformers' config, says)
    and its tokenizer."""
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.embedding_loader import load_embedding_model

    model = load_embedding_model(model_dir)
    model.pooling_config = pooling
    return model, load_tokenizer(model_dir)


def encode_rows(model: nn.Module, rows: list[list[int]], pad: int) -> np.ndarray:
    """ENGINE THREAD. One pass of `rows`, padded on the right with `pad` and masked: the
    model's pooled, normalised vectors (float32, one per row)."""
    width = max(len(row) for row in rows)
    ids = mx.array([row + [pad] * (width - len(row)) for row in rows], dtype=mx.int32)
    mask = (mx.arange(width)[None, :] < mx.array([len(r) for r in rows])[:, None]).astype(mx.int32)
    vectors = model(ids, attention_mask=mask).text_embeds.astype(mx.float32)
    mx.eval(vectors)
    return np.array(vectors, dtype=np.float32)


class _NoKV:
    """An encoder's KV layout: none (for the status page)."""

    bytes_per_token = 0

    def summary(self) -> str:
        return "an encoder: no KV cache"


class EncoderEngine:
    """A model that only embeds, on its own thread (the pool loads and unloads it as any)."""

    generates = False
    vision = None  # (an encoder sees no images)
    unloadable = True
    cluster: dict[str, JSON] | None = None
    prompt_cache = None
    generator = None  # no generation, KV ledger or decode batch (None: as read by /metrics)
    room = None
    batch = None
    kv_budget = 0
    queued = 0
    running = 0
    paused = 0

    def __init__(
        self,
        load: Callable[[], tuple[nn.Module, TokenizerWrapper]],
        *,
        context_length: int | None,
        mlx_cache_limit: int = 0,
    ) -> None:
        self._load = load
        self.context_length = context_length
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.failure: str | None = None
        self.model: nn.Module | None = None
        self.tokenizer: TokenizerWrapper | None = None
        self.layout = _NoKV()
        self.busy_seconds = 0.0  # in calls: the embedding batches (/metrics)
        self.memory = MemoryPolicy(mlx_cache_limit)
        self._calls = CallQueue()  # the engine's own queue of calls (engine/calls.py)
        self._wake = threading.Event()  # a call queued, or the stop
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mlx-kvserve-encoder", daemon=True)

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def _run(self) -> None:
        try:
            self.model, self.tokenizer = self._load()
            self.memory.start(self.model)
        except Exception as exc:
            self.load_error = f"model failed to load: {exc}"
            log.error("%s\n%s", self.load_error, traceback.format_exc())
            self._calls.fail_all(EngineNotReady(self.load_error))
            return
        self.ready.set()
        log.info("ready: an embedding model (encoder), context %s", self.context_length)
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()
            started = time.perf_counter()
            self._calls.run()
            self.busy_seconds += time.perf_counter() - started
        self.failure = "the engine stopped"
        self._calls.fail_all(EngineNotReady(self.failure))  # calls queued behind the stop

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread, after the calls queued before it."""
        down = self._stopping or (not self._thread.is_alive() and self.ready.is_set())
        future = self._calls.put(fn, EngineNotReady("the engine stopped") if down else None)
        self._wake.set()
        return future

    def submit(self, req: GenerationRequest) -> None:
        raise EngineNotReady("an embedding model does not generate text")

    def add_observer(self, observer: Callable[..., None]) -> None:
        """No generation request ever ends here: nothing to observe."""

    def drain(self, grace: float) -> None:
        """Embedding batches are short: nothing to wait for."""

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join()

    async def stop_async(self) -> None:
        await asyncio.to_thread(self.stop)
