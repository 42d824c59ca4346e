"""What travels between the event loop and the engine thread: a request in, events out.

Events cross threads through `loop.call_soon_threadsafe`, so the event loop never blocks on the
engine and the engine never touches asyncio objects directly.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, runtime_checkable

import numpy as np

from mlx_kvserve.engine.image_prefill import Image
from mlx_kvserve.engine.namespaces import current_namespace
from mlx_kvserve.images.spans import ImageSpan, check_spans


class CancelLatch:
    """A request's cancel flag on rank 0 of a job: `set()` from any thread asks, and the engine
    makes the ask take effect (`latch`) at the start of a turn, when it tells the other ranks.
    Until the request is shared with them (`hold`), asks take effect at once: a queued request
    the client left gives up its place in the queue straight away."""

    def __init__(self) -> None:
        self._asked = threading.Event()
        self._held = False
        self._seen = False

    def set(self) -> None:
        self._asked.set()

    def is_set(self) -> bool:
        return self._seen if self._held else self._asked.is_set()

    def hold(self) -> bool:
        """From now on asks wait for `latch`; whether it is cancelled already."""
        self._held, self._seen = True, self._asked.is_set()
        return self._seen

    def latch(self) -> bool:
        """Take the ask into effect; whether it just did."""
        if self._seen or not self._asked.is_set():
            return False
        self._seen = True
        return True

    def set_now(self) -> None:
        """Cancelled on every rank at the same point of the loop (the engine stopping)."""
        self._asked.set()
        self._seen = True


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    logprobs: bool = False  # report each sampled token's log probability
    top_logprobs: int = 0  # ... and this many most likely alternatives
    # End-of-sequence ids are never sampled (unless a grammar allows nothing else): the answer
    # runs to max_tokens, a stop string or its grammar's end (the `ignore_eos` extension).
    ignore_eos: bool = False
    # False: the request's row drafts nothing under `--speculation auto` (the per-request
    # opt-out: `speculative: false`, Ollama's `draft_num_predict: 0`); its tokens are the same.
    speculative: bool = True


class TokenConstraint(Protocol):
    """A grammar that decides which tokens may come next (see chat.grammar.Constraint)."""

    def allowed(self, n_logits: int) -> np.ndarray | None: ...  # boolean mask over the logits
    def advance(self, token: int) -> None: ...
    def forced(self, limit: int) -> list[int]: ...  # next tokens with no alternative (consumed)
    @property
    def finished(self) -> bool: ...


@runtime_checkable
class Forkable(TokenConstraint, Protocol):
    """A constraint that can copy itself in its current state (chat.grammar.Constraint, the
    reasoning gate, Harmony's analysis gate): the kind whose rows speculative decoding drafts
    for. A draft is walked through the copy (engine/decode.py `Decoder.walk`), so the row's
    own grammar only ever takes the tokens it emits, and a draft that drives the grammar into
    an error cannot leave the row's in it."""

    def fork(self) -> Forkable: ...


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log probability and the most likely alternatives at its position."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(frozen=True)
class TextChunk:
    """New completion text (already checked against stop strings) and its tokens' logprobs."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Prefilled:
    """The prompt is in the KV cache; decoding starts. Lets a protocol report input usage early."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Done:
    """The request finished; carries the usage figures for the response."""

    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop_sequence: str | None = None  # the stop string that ended the text, if one did


@dataclass(frozen=True)
class EngineError:
    """The request failed inside the engine; the message is safe to show to the client."""

    message: str


Event = Prefilled | TextChunk | Done | EngineError


@dataclass
class GenerationRequest:
    """One completion request as the engine sees it: token ids in, events out."""

    prompt_tokens: list[int]
    params: SamplingParams
    kind: str = "chat"
    # Prompt positions worth a checkpoint: {token count: "anchor" | "message" | "prompt"}
    # (see chat.render)
    boundaries: dict[int, str] = field(default_factory=dict)
    constraint: TokenConstraint | None = None  # grammar-constrained decoding, if asked for
    # Where images sit in the prompt: the prompt cache keys those positions by the pixels' hash
    # (images/spans.py), while the model is fed `prompt_tokens` as they are.
    image_spans: tuple[ImageSpan, ...] = ()
    token_bytes: Callable[[int], bytes] | None = None  # a token's bytes, for logprobs
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)  # for time-to-first-token
    cancelled: threading.Event | CancelLatch = field(default_factory=threading.Event)
    namespace: str | None = field(default_factory=current_namespace.get)  # per-key cache
    # The token ids sampled so far, end-of-sequence token excluded (written by the engine thread;
    # read once Done arrives): what a tool loop's next prompt splices back
    # (chat.reasoning.sampled_turns).
    sampled: list[int] = field(default_factory=list)
    # The other choices of an `n` request (OpenAI's `n`): each its own request (seed, grammar,
    # events), decoded as its own row from a copy of this request's prefilled KV, so the prompt
    # is prefilled once. Only this request's output extends the prompt cache.
    forks: list[GenerationRequest] = field(default_factory=list)
    choice: int = 0  # which choice of its `n` request this is (0: the one that prefills)
    # The images of `image_spans`, one per span: a vision model's prefill embeds them
    # (engine/image_prefill.py)
    images: tuple[Image, ...] = ()
    _loop: asyncio.AbstractEventLoop | None = None
    _events: asyncio.Queue[Event] | None = None

    def __post_init__(self) -> None:
        if self.image_spans:
            check_spans(len(self.prompt_tokens), self.image_spans)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach the event loop that will consume this request's events."""
        self._loop = loop
        self._events = asyncio.Queue()

    def emit(self, event: Event) -> None:
        """Called on the engine thread: hand an event to the event loop."""
        if self._loop is None or self._events is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # loop closed during shutdown: nobody is listening any more
            self.cancelled.set()

    async def next_event(self, timeout: float | None = None) -> Event | None:
        """Next event, or None if `timeout` seconds pass first (used for SSE keep-alives)."""
        assert self._events is not None, "bind() the request before waiting on it"
        try:
            return await asyncio.wait_for(self._events.get(), timeout)
        except TimeoutError:
            return None

    def cancel(self) -> None:
        self.cancelled.set()

    def cancel_now(self) -> None:
        """Cancelled at this point of the engine's loop, on every rank of a job alike."""
        flag = self.cancelled
        (flag.set_now if isinstance(flag, CancelLatch) else flag.set)()


class Stop:
    """The queue item that stops the engine thread (`STOP`, the only one)."""

    def __repr__(self) -> str:
        return "STOP"


STOP = Stop()

# What the engine takes from its queue at a turn's start: a request, the order to stop, nothing.
Item: TypeAlias = "GenerationRequest | Stop | None"
