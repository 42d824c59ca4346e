"""What the API asks of a model's engine: a Protocol, so that api/ knows the surface it calls
and nothing else of the engine (engine/worker.py's `Engine` is the one that has it).

The endpoints submit requests, run a function on the engine thread (reading the prompt cache,
MLX's memory figures), and report what the engine last counted: its queue, its KV ledger and
the shape of a token's KV. tests/unit/test_engine_view.py checks that the real engine has every
member named here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from mlx_kvserve.engine import GenerationRequest
from mlx_kvserve.engine.image_prefill import Markup
from mlx_kvserve.engine.live import Timings
from mlx_kvserve.engine.namespaces import Caches
from mlx_kvserve.json_value import JSON

if TYPE_CHECKING:  # only named here
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

T = TypeVar("T")


@runtime_checkable
class KVLedger(Protocol):
    """The KV memory the engine's admission counts (engine/room.py: `Room`)."""

    @property
    def last(self) -> dict[str, int]: ...  # as last counted, safe to read on any thread

    def report(self) -> dict[str, int]: ...  # part by part, on the engine thread


@runtime_checkable
class KVShape(Protocol):
    """The loaded model's KV per token, for the status page (cache/kinds.py: `KVLayout`)."""

    @property
    def bytes_per_token(self) -> int: ...

    def summary(self) -> str: ...


@runtime_checkable
class MemoryFigures(Protocol):
    """MLX's memory figures (engine/memory.py: `MemoryPolicy`), read on the engine thread."""

    def stats(self) -> dict[str, int]: ...


@runtime_checkable
class EngineView(Protocol):
    """One model's engine as the endpoints use it. Its model, tokenizer, ledger and KV shape
    are there (not None) once `ready` is set; the API asks only engines that are."""

    @property
    def ready(self) -> threading.Event: ...

    @property
    def generates(self) -> bool: ...  # False: a model that only embeds (embed/encoder.py)

    @property
    def load_error(self) -> str | None: ...

    @property
    def failure(self) -> str | None: ...  # why its loop stopped, if a failure stopped it

    @property
    def cluster(self) -> dict[str, JSON] | None: ...  # the job's ranks, for /health

    @property
    def model(self) -> nn.Module | None: ...

    @property
    def tokenizer(self) -> TokenizerWrapper | None: ...

    @property
    def vision(self) -> Markup | None: ...  # a vision model's prompt markup (chat/image_markup.py)

    @property
    def context_length(self) -> int | None: ...

    @property
    def kv_budget(self) -> int | None: ...

    @property
    def prompt_cache(self) -> Caches: ...

    @property
    def room(self) -> KVLedger | None: ...

    @property
    def layout(self) -> KVShape | None: ...

    @property
    def memory(self) -> MemoryFigures: ...

    @property
    def queued(self) -> int: ...

    @property
    def running(self) -> int: ...

    @property
    def paused(self) -> int: ...

    def submit(self, req: GenerationRequest) -> None: ...

    def call(self, fn: Callable[[], T]) -> Future[T]: ...

    def add_observer(
        self, observer: Callable[[GenerationRequest, Timings | None], None]
    ) -> None: ...


__all__ = ["EngineView", "KVLedger", "KVShape", "MemoryFigures"]
