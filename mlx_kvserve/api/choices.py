"""Several choices of one request (OpenAI's `n`): their fan-out and the merge of their answers.

api/generation.py queues choice 0 with the others as its forks: the engine prefills the prompt
once and decodes each choice as its own row from a copy of its KV (engine/generate.py). Each
choice is a `Generation` of its own (its seed, grammar, tool-call parser, finish reason);
`Choices` reads them together, for the OpenAI chat and text adapters: one merged event stream
(each event with its choice's index) or all the results, and their usage, which counts the prompt
once and every choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request

from mlx_kvserve.api.disconnect import DisconnectWatch
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.reading import Event, Failed, Finished, Generation, Logprobs, Result, Usage
from mlx_kvserve.engine import GenerationRequest
from mlx_kvserve.engine.requests import TokenConstraint, TokenLogprob

SEEDS = 2**64  # MLX seeds are uint64: choice i's seed + i wraps around


def fork_of(
    req: GenerationRequest, i: int, constraint: TokenConstraint | None
) -> GenerationRequest:
    """Choice `i` of `req`: the same prompt and sampling, seeded `seed + i` (a seeded request
    with several choices reproduces, and its choices differ), with a grammar of its own."""
    seed = req.params.seed
    return GenerationRequest(
        prompt_tokens=req.prompt_tokens,
        params=dataclasses.replace(req.params, seed=None if seed is None else (seed + i) % SEEDS),
        kind=req.kind,
        constraint=constraint,
        token_bytes=req.token_bytes,
        request_id=f"{req.request_id}-{i}",
        created=req.created,
        started=req.started,
        namespace=req.namespace,
        choice=i,
        image_spans=req.image_spans,
        images=req.images,
    )


def last_of(calls: int, fn: Callable[[], None]) -> Callable[[], None]:
    """`fn`, run on the last of `calls` calls: the choices share one model lease, which goes
    when the last of them ends."""
    left = [calls]

    def call() -> None:
        left[0] -= 1
        if left[0] == 0:
            fn()

    return call


@dataclass(frozen=True)
class ChoiceEvent:
    """One choice's event, with the choice's index."""

    index: int
    event: Event


@dataclass(frozen=True)
class Ended:
    """Every choice has finished: the request's usage."""

    usage: Usage


def total_usage(finished: list[Finished]) -> Usage:
    """The prompt once (choice 0 prefilled it), every choice's completion tokens."""
    first = finished[0].usage
    return Usage(
        first.prompt_tokens,
        first.cached_tokens,
        sum(f.usage.completion_tokens for f in finished),
        sum(f.usage.reasoning_tokens for f in finished),
    )


class Choices:
    """The choices of one request, read together."""

    def __init__(self, generation: Generation) -> None:
        self.all = [generation, *generation.others]
        self.first = generation

    def cancel(self) -> None:
        for generation in self.all:
            generation.req.cancel()

    async def events(
        self, keepalive: float | None = None
    ) -> AsyncIterator[ChoiceEvent | Ended | None]:
        """Every choice's events as they come; None when `keepalive` seconds pass with nothing
        new; `Ended` after the last choice finished. A failure ends it all (the stream can carry
        one error): the first `Failed` is the last event. Leaving early cancels every choice."""
        queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            async for event in generation.events():
                queue.put_nowait(ChoiceEvent(index, event))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.all)]
        finished: dict[int, Finished] = {}
        try:
            while len(finished) < len(self.all):
                try:
                    item = await asyncio.wait_for(queue.get(), keepalive)
                except TimeoutError:
                    yield None
                    continue
                yield item
                if isinstance(item.event, Finished):
                    finished[item.index] = item.event
                elif isinstance(item.event, Failed):
                    return
            yield Ended(total_usage([finished[i] for i in range(len(self.all))]))
        finally:
            for task in tasks:
                task.cancel()
            self.cancel()  # no-op for finished choices; a task cancelled unstarted never ran
            for generation in self.all:
                generation.close()

    async def results(self, request: Request) -> tuple[list[Result], Usage]:
        """Every choice's whole answer and the usage; all are cancelled the moment the client
        disconnects."""
        watch = DisconnectWatch(request, self)
        logprobs: list[list[TokenLogprob]] = [[] for _ in self.all]
        results: dict[int, Result] = {}
        try:
            async for item in self.events():
                if isinstance(item, Ended):
                    return [results[i] for i in range(len(self.all))], item.usage
                if item is None:
                    continue
                event, i = item.event, item.index
                if isinstance(event, Logprobs):
                    logprobs[i].extend(event.items)
                elif isinstance(event, Finished):
                    parser = self.all[i].parser
                    results[i] = Result(
                        parser.content, parser.calls, event, logprobs[i], parser.reasoning
                    )
                elif isinstance(event, Failed):
                    if watch.gone.is_set():
                        raise APIError(499, "client disconnected")
                    raise APIError(event.status, event.message, code="engine_error")
        finally:
            watch.close()
        raise APIError(500, "the generation ended without a result", code="engine_error")

    @property
    def id(self) -> str:
        return self.first.id

    @property
    def created(self) -> int:
        return self.first.created

    @property
    def model(self) -> str:
        return self.first.model
