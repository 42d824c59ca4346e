"""What a generation sends back, as protocol-neutral events, and the object that reads them.

`Generation.events()` (streaming) and `Generation.result()` (one body) turn the engine's events
into reasoning, content, tool calls, logprobs and usage; api.generation starts generations.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from mlx_kvserve.api.disconnect import DisconnectWatch
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.chat import ToolCall
from mlx_kvserve.chat.events import OutputEvent, OutputReader
from mlx_kvserve.engine import Done, EngineError, GenerationRequest, Prefilled, TextChunk
from mlx_kvserve.engine.requests import TokenLogprob


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0  # of completion_tokens, those of the reasoning section

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Logprobs:
    """Log probabilities of tokens generated since the previous event."""

    items: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Started:
    """Prefill is done: the prompt's size and how much of it came from the cache."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop", "length" or "tool_calls"
    usage: Usage
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Failed:
    """The generation broke off after it started (shutdown, engine error)."""

    status: int
    message: str


Event = OutputEvent | Started | Logprobs | Finished | Failed


@dataclass
class Result:
    """A whole non-streamed answer."""

    content: str
    calls: list[ToolCall]
    finished: Finished
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: str = ""  # the reasoning section, apart from `content` (empty: none)


class Generation:
    """A request submitted to the engine, read back as protocol-neutral events."""

    def __init__(
        self,
        req: GenerationRequest,
        parser: OutputReader,
        model: str,
        count_tokens: Callable[[str], int] | None = None,
        release: Callable[[], None] | None = None,
        on_done: Callable[[Generation, Done], None] | None = None,
    ) -> None:
        self.req = req
        self.parser = parser
        self.model = model  # the name the response reports: the served model's id
        self.count_tokens = count_tokens  # the tokenizer's count, for the reasoning's usage
        # the model's lease (models.pool): held until the stream ends, so it is not unloaded
        self._release = weakref.finalize(self, release) if release else None
        self.on_done = on_done  # called as it ends on its own: e.g. keep the sampled turn
        self.prefilled_at: float | None = None  # time.perf_counter() when prefill ended
        self.others: list[Generation] = []  # the request's other choices (api/choices.py)

    def close(self) -> None:
        """Let the model go (idempotent); the stream's end does it too."""
        if self._release is not None:
            self._release()

    @property
    def id(self) -> str:
        return self.req.request_id

    @property
    def created(self) -> int:
        return int(self.req.created)

    async def events(self, keepalive: float | None = None) -> AsyncIterator[Event | None]:
        """Output events in order; None when `keepalive` seconds pass with nothing new.

        Leaving the iteration early (client gone) cancels the request, which the engine
        notices within one decode step or prefill chunk.
        """
        try:
            while True:
                event = await self.req.next_event(timeout=keepalive)
                if event is None:
                    yield None
                elif isinstance(event, Prefilled):
                    self.prefilled_at = time.perf_counter()
                    yield Started(event.prompt_tokens, event.cached_tokens)
                elif isinstance(event, TextChunk):
                    if event.logprobs:
                        yield Logprobs(event.logprobs)
                    for item in self.parser.feed(event.text):
                        yield item
                elif isinstance(event, Done) and event.finish_reason != "cancelled":
                    for item in self.parser.finish():
                        yield item
                    if self.on_done is not None:
                        self.on_done(self, event)
                    yield self._finished(event)
                    return
                elif isinstance(event, Done):
                    yield Failed(503, "generation was cancelled: the server is shutting down")
                    return
                else:
                    assert isinstance(event, EngineError)
                    yield Failed(500, event.message)
                    return
        finally:
            self.req.cancel()  # no-op when finished; stops the engine when the client left
            self.close()

    async def result(self, request: Request) -> Result:
        """The whole answer; the request is cancelled the moment the client disconnects."""
        watch = DisconnectWatch(request, self.req)
        logprobs: list[TokenLogprob] = []
        try:
            async for event in self.events():
                if isinstance(event, Logprobs):
                    logprobs.extend(event.items)
                elif isinstance(event, Finished):
                    parser = self.parser
                    return Result(
                        parser.content, parser.calls, event, logprobs, reasoning=parser.reasoning
                    )
                elif isinstance(event, Failed):
                    if watch.gone.is_set():
                        raise APIError(499, "client disconnected")
                    raise APIError(event.status, event.message, code="engine_error")
        finally:
            watch.close()
        raise APIError(500, "the generation ended without a result", code="engine_error")

    def _finished(self, done: Done) -> Finished:
        reason = done.finish_reason
        if reason == "stop" and self.parser.calls:
            reason = "tool_calls"
        usage = Usage(
            done.prompt_tokens,
            done.cached_tokens,
            done.completion_tokens,
            self._reasoning_tokens(done.completion_tokens),
        )
        return Finished(reason, usage, done.stop_sequence)

    def _reasoning_tokens(self, completion_tokens: int) -> int:
        """The reasoning's tokens: the engine streams text, not tokens per section, so its text
        is counted again by the tokenizer (the sampled tokens may have split it differently)."""
        reasoning = self.parser.reasoning
        if not reasoning or self.count_tokens is None:
            return 0
        return min(self.count_tokens(reasoning), completion_tokens)
