"""Text completions that echo their prompt or send several prompts, as evaluation harnesses do
(lm-evaluation-harness's `local-completions`): `echo` puts the prompt before the completion,
with `logprobs` its tokens' log probabilities (the first token's `null`); `max_tokens: 0` scores
the prompt and generates nothing; `prompt` as a list of up to 64 prompts answers one choice per
prompt, in order. Not streamed: a streamed request with either gets a 400 naming the field.

The prompt's figures come from the model's prompt scorer (engine/scorer.py), which runs every
position from the start on the engine thread between generation's steps; the completion, if
any, is an ordinary generation of each prompt's tokens (api/generation.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_kvserve.api.disconnect import unless_gone
from mlx_kvserve.api.embedding import tokenized
from mlx_kvserve.api.engine_view import EngineView
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.generation import (
    acquire_generator,
    served_model,
    start_text,
    token_bytes,
    unavailable,
)
from mlx_kvserve.api.openai_chat import SYSTEM_FINGERPRINT, finite, token_text, usage
from mlx_kvserve.api.reading import Result, Usage
from mlx_kvserve.api.schemas import CompletionRequest
from mlx_kvserve.chat import Sampling
from mlx_kvserve.engine import EngineNotReady
from mlx_kvserve.engine.prompt_logprobs import PromptLogprobs
from mlx_kvserve.engine.scorer import Scorer
from mlx_kvserve.json_value import JSON
from mlx_kvserve.vocabulary import vocabulary_size

# One position of the legacy logprobs: the token's bytes, its log probability (None for the
# first prompt token), the alternatives (None for the first prompt token).
Entry = tuple[bytes, float | None, list[tuple[bytes, float]] | None]

_scorers: weakref.WeakKeyDictionary[EngineView, Scorer] = weakref.WeakKeyDictionary()


def wanted(body: CompletionRequest) -> bool:
    """Whether a completion request is this module's: echo, several prompts, or no tokens."""
    return body.echo or len(body.prompt) > 1 or body.max_tokens == 0


def text_sampling(body: CompletionRequest) -> Sampling:
    """A text completion's sampling settings (with echo or without: openai_text's too)."""
    return body.sampling(body.logprobs)


async def completions(request: Request, body: CompletionRequest) -> Response:
    """Echo, several prompts, or scoring alone (`max_tokens: 0`), as one body."""
    if body.max_tokens == 0 and not body.echo:
        raise APIError(
            400, "'max_tokens' 0 generates nothing: it needs 'echo' true", param="max_tokens"
        )
    if body.stream:
        field = "echo" if body.echo else "prompt"
        raise APIError(
            400,
            f"'{field}' is not supported with 'stream': send the request without streaming",
            param=field,
        )
    slot = served_model(request, body.model)
    engine = await acquire_generator(request, slot)
    try:
        rows = await run_in_threadpool(
            tokenized, engine, body.prompt, "prompt", False, engine.context_length, "score"
        )
        scored: list[PromptLogprobs] | None = None
        if body.echo and body.logprobs is not None:
            scored = await _score(request, engine, rows, body.logprobs)
            if scored is None:  # the client left
                return Response(status_code=204)
        results: list[Result | None] = [None] * len(rows)
        if body.max_tokens != 0:
            sampling = text_sampling(body)
            tasks = [asyncio.ensure_future(_generate(request, r, sampling, body)) for r in rows]
            try:
                results = list(await asyncio.gather(*tasks))
            except BaseException:  # one failed (or the client left): the others stop too
                for task in tasks:
                    task.cancel()
                raise
        name = token_bytes(engine)
        choices = [
            _choice(i, engine, body, row, scored[i] if scored else None, result, name)
            for i, (row, result) in enumerate(zip(rows, results, strict=True))
        ]
    finally:
        request.app.state.pool.release(slot)
    head = {
        "id": "cmpl-" + uuid.uuid4().hex[:24],
        "object": "text_completion",
        "created": int(time.time()),
        "model": slot.name,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
    return JSONResponse({**head, "choices": choices, "usage": usage(_usage(rows, results))})


def _choice(
    index: int,
    engine: EngineView,
    body: CompletionRequest,
    row: list[int],
    scored: PromptLogprobs | None,
    result: Result | None,
    name: Callable[[int], bytes],
) -> JSON:
    """One prompt's choice: its text (after the prompt's, with `echo`) and logprobs."""
    text = result.content if result else ""
    entries: list[Entry] = []
    if body.echo:
        prompt = body.prompt[index]
        assert engine.tokenizer is not None
        text = (prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)) + text
        if scored is not None:
            entries = _prompt_entries(row, scored, body.logprobs or 0, name)
    if result is not None and body.logprobs is not None:
        entries += [(t.token, t.logprob, list(t.top)) for t in result.logprobs]
    return {
        "index": index,
        "text": text,
        "logprobs": _legacy(entries) if body.logprobs is not None else None,
        "finish_reason": result.finished.reason if result else "length",
    }


async def _generate(
    request: Request, row: list[int], sampling: Sampling, body: CompletionRequest
) -> Result:
    generation = await start_text(request, row, sampling, model=body.model)
    return await generation.result(request)


async def _score(
    request: Request, engine: EngineView, rows: list[list[int]], top: int
) -> list[PromptLogprobs] | None:
    """The prompts' own log probabilities (None: the client left first)."""
    if engine.cluster is not None:
        raise APIError(
            501,
            "prompt log probabilities ('echo' with 'logprobs') are not served by a job across "
            "machines yet; serve the model from one machine",
            param="echo",
        )
    scorer = _scorers.get(engine)
    if scorer is None:
        counted = request.app.state.metrics.scored_prompts
        scorer = _scorers[engine] = Scorer(
            engine,
            vocabulary_size(engine.tokenizer),
            count=lambda outcome, n: counted.labels(outcome).inc(n),
        )
    job = scorer.submit(rows, top)
    try:
        return await unless_gone(request, job, job.done)
    except EngineNotReady as exc:
        raise unavailable(str(exc)) from None


def _prompt_entries(
    row: list[int], scored: PromptLogprobs, top: int, name: Callable[[int], bytes]
) -> list[Entry]:
    entries: list[Entry] = [(name(row[0]), None, None)]
    for j, token in enumerate(row[1:]):
        ids = scored.top_ids[j, :top].tolist()
        values = scored.top_logprobs[j, :top].tolist()
        alternatives = [(name(int(t)), float(v)) for t, v in zip(ids, values, strict=True)]
        entries.append((name(token), float(scored.logprobs[j]), alternatives))
    return entries


def _legacy(entries: list[Entry]) -> dict[str, JSON]:
    """OpenAI's legacy completions shape: parallel lists plus each token's text offset."""
    tokens = [token_text(raw) for raw, _, _ in entries]
    offsets: list[JSON] = []
    offset = 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": list(tokens),
        "token_logprobs": [None if lp is None else finite(lp) for _, lp, _ in entries],
        "top_logprobs": [
            None if top is None else {token_text(t): finite(v) for t, v in top}
            for _, _, top in entries
        ],
        "text_offset": offsets,
    }


def _usage(rows: list[list[int]], results: list[Result | None]) -> Usage:
    done = [r.finished.usage for r in results if r is not None]
    return Usage(
        prompt_tokens=sum(len(row) for row in rows),
        cached_tokens=sum(u.cached_tokens for u in done),
        completion_tokens=sum(u.completion_tokens for u in done),
    )
