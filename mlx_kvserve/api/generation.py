"""Running one internal request on the engine.

Every protocol adapter calls `start_chat` or `start_text`, then reads `Generation.events()`
(streaming) or `Generation.result()` (one body; api.reading). Model-name resolution, loading on
demand, templating, grammar compilation, context-window checks, queueing and tool-call parsing
live here once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from mlx_kvserve.api.choices import fork_of, last_of
from mlx_kvserve.api.engine_view import EngineView
from mlx_kvserve.api.errors import APIError
from mlx_kvserve.api.images import for_model
from mlx_kvserve.api.reading import Generation
from mlx_kvserve.chat import ChatRequest, InvalidRequest, Sampling
from mlx_kvserve.chat.events import OutputReader
from mlx_kvserve.chat.formats.tool_format import ToolFormat
from mlx_kvserve.chat.grammar import GrammarCompiler
from mlx_kvserve.chat.output import OutputParser
from mlx_kvserve.chat.reasoning.sampled_turns import SampledTurns
from mlx_kvserve.chat.render import (
    Prompt,
    continuing,
    render_chat,
    render_text,
    render_token_ids,
)
from mlx_kvserve.engine import (
    Done,
    EngineBusy,
    EngineNotReady,
    GenerationRequest,
    RequestTooLarge,
    SamplingParams,
)
from mlx_kvserve.engine.requests import TokenConstraint
from mlx_kvserve.json_value import JSON
from mlx_kvserve.models.pool import ModelLoadFailed, ModelPool, ModelTooLarge, Slot

RETRY_AFTER_SECONDS = "2"
DEFAULT_MAX_TOKENS = 256  # only when the model declares no context length
T = TypeVar("T")


def served_model(request: Request, asked: str | None, param: str = "model") -> Slot:
    """The model a request names (an id or alias); any other name is served by the default
    model unless names are strict."""
    state = request.app.state
    pool: ModelPool = state.pool
    slot = pool.find(asked)
    if slot is not None:
        return slot
    if state.settings.strict_model_names:
        raise APIError(
            404,
            f"The model {asked!r} does not exist; this server serves {sorted(pool.names())}.",
            param=param,
            code="model_not_found",
        )
    return pool.default


async def acquire_model(request: Request, slot: Slot) -> EngineView:
    """The slot's engine, loading its model if needed (the request waits meanwhile); the
    caller owns a lease on the model and must release it."""
    pool: ModelPool = request.app.state.pool
    try:
        engine = await pool.acquire(slot)
    except ModelTooLarge as exc:
        raise APIError(400, str(exc), param="model", code="model_too_large") from None
    except ModelLoadFailed as exc:
        raise unavailable(f"The model {slot.name!r} could not be loaded: {exc}") from None
    if not engine.ready.is_set():
        pool.release(slot)
        raise unavailable(engine.load_error or "The model is still loading; retry shortly.")
    return engine


async def acquire_generator(request: Request, slot: Slot) -> EngineView:
    """`acquire_model` for a generation: a model that only embeds is a 400."""
    engine = await acquire_model(request, slot)
    if not engine.generates:
        request.app.state.pool.release(slot)
        raise APIError(
            400,
            f"the model {slot.name!r} is an embedding model: it does not generate text "
            "(ask it for embeddings)",
            param="model",
        )
    return engine


async def start_chat(
    request: Request,
    chat: ChatRequest,
    *,
    model: str | None,
    id_prefix: str = "call_",
    kind: str = "chat",
    context: list[int] | None = None,
    n: int = 1,
) -> Generation:
    """Template, constrain and queue a chat request (raises APIError for the client);
    `context`: token ids the prompt continues (Ollama's, checked by the caller); `n` choices:
    the others are the returned generation's `others` (api/choices.py)."""
    slot = served_model(request, model)
    settings = request.app.state.settings
    chat = for_model(chat, slot, settings.images)
    engine = await acquire_generator(request, slot)

    sampled = sampled_turns(request)

    def build() -> tuple[Prompt, list[TokenConstraint | None]]:
        defaults = settings.template_defaults()
        prompt = render_chat(engine.tokenizer, chat, defaults, sampled, slot.name, engine.vision)
        prompt = continuing(prompt, context or [])
        fmt = _format(prompt)
        budget = chat.thinking.budget or settings.thinking_budget or None
        gates = []
        for _ in range(n):  # a grammar's state is a choice's own
            grammar = _grammar(engine).constraint_for(chat, fmt)
            gates.append(
                fmt.thinking_gate(
                    engine.tokenizer, grammar, budget, prompt.markers, prompt.reasoning
                )
            )
        return prompt, gates

    try:
        prompt, constraints = await _off_loop(build)
        parsers: list[OutputReader] = [
            _format(prompt).reader(
                chat.tools,
                parse_calls=chat.tools_active,
                id_prefix=id_prefix,
                markers=prompt.markers,
                reasoning=prompt.reasoning,
            )
            for _ in range(n)
        ]
        keep = functools.partial(_keep_turn, sampled, slot.name, prompt)
        return _submit(
            request, engine, slot, prompt, chat.sampling, kind, parsers, constraints, on_done=keep
        )
    except BaseException:
        request.app.state.pool.release(slot)
        raise


def _format(prompt: Prompt) -> ToolFormat:
    """The model's tool format, which a chat prompt always has: it decides how the answer is
    constrained and read back."""
    assert prompt.tool_format is not None
    return prompt.tool_format


def sampled_turns(request: Request) -> SampledTurns:
    """`app.state.sampled_turns`: the server's kept tool-calling turns
    (chat.reasoning.sampled_turns)."""
    return request.app.state.sampled_turns


def _keep_turn(
    kept: SampledTurns, model: str, prompt: Prompt, generation: Generation, done: Done
) -> None:
    """Keep an answer that ended on its own with tool calls: its tokens are all sampled text."""
    parser = generation.parser
    if done.finish_reason == "stop" and done.stop_sequence is None and parser.calls:
        tokens = generation.req.sampled
        kept.remember(model, prompt.text, tokens, parser.content, parser.reasoning, parser.calls)


async def start_text(
    request: Request,
    text: str | list[int],
    sampling: Sampling,
    *,
    model: str | None,
    schema: tuple[dict[str, JSON], str] | None = None,
    n: int = 1,
) -> Generation:
    """Tokenize (or check the token ids of) and queue a plain text completion; `schema`: the
    JSON Schema its answer follows and the field that gave it (Ollama's `format`); `n`
    choices: see `start_chat`."""
    slot = served_model(request, model)
    engine = await acquire_generator(request, slot)
    try:
        if isinstance(text, str):
            prompt = await _off_loop(lambda: render_text(engine.tokenizer, text))
        else:
            prompt = await _off_loop(lambda: render_token_ids(engine.tokenizer, text))
        constraints: list[TokenConstraint | None] = [None] * n
        if schema is not None:
            grammar = _grammar(engine)
            constraints = await _off_loop(
                lambda: [grammar.json_constraint(*schema) for _ in range(n)]
            )
        parsers: list[OutputReader] = [OutputParser(None) for _ in range(n)]
        return _submit(request, engine, slot, prompt, sampling, "text", parsers, constraints)
    except BaseException:
        request.app.state.pool.release(slot)
        raise


async def count_chat_tokens(request: Request, chat: ChatRequest, model: str | None) -> int:
    """The prompt tokens a chat request would have (for token-counting endpoints)."""
    pool: ModelPool = request.app.state.pool
    slot = served_model(request, model)
    chat = for_model(chat, slot, request.app.state.settings.images)
    engine = await acquire_generator(request, slot)
    defaults = request.app.state.settings.template_defaults()
    kept = sampled_turns(request)
    try:
        return await _off_loop(
            lambda: len(
                render_chat(engine.tokenizer, chat, defaults, kept, slot.name, engine.vision).tokens
            )
        )
    finally:
        pool.release(slot)


async def _off_loop(fn: Callable[[], T]) -> T:
    try:
        return await run_in_threadpool(fn)
    except InvalidRequest as exc:
        raise APIError(400, exc.message, param=exc.param, code=exc.code) from None


_compilers: weakref.WeakKeyDictionary[EngineView, GrammarCompiler] = weakref.WeakKeyDictionary()


def _grammar(engine: EngineView) -> GrammarCompiler:
    """The model's grammar compiler (its tokenizer's), made once per loaded engine."""
    compiler = _compilers.get(engine)
    if compiler is None:
        compiler = _compilers[engine] = GrammarCompiler(engine.tokenizer)
    return compiler


def token_bytes(engine: EngineView) -> Callable[[int], bytes]:
    """A token's exact bytes, as logprobs name tokens (the grammar compiler's tokenizer)."""
    return _grammar(engine).token_bytes


def _submit(
    request: Request,
    engine: EngineView,
    slot: Slot,
    prompt: Prompt,
    sampling: Sampling,
    kind: str,
    parsers: list[OutputReader],
    constraints: list[TokenConstraint | None],
    *,
    on_done: Callable[[Generation, Done], None] | None = None,
) -> Generation:
    """Queue the request: one choice per parser and constraint, forks of the first (its
    `others`), which the engine prefills once."""
    want_bytes = sampling.logprobs or sampling.top_logprobs > 0
    params = _sampling(sampling, len(prompt.tokens), engine.context_length, kind)
    if params.seed is None and request.app.state.settings.seed >= 0:  # --seed: the default
        params = dataclasses.replace(params, seed=request.app.state.settings.seed)
    if prompt.images and engine.cluster is not None:  # the request's wire carries no pixels
        raise APIError(
            400,
            "Images are not supported when the server runs as a cluster job.",
            param="messages",
            code="images_not_supported",
        )
    if len(parsers) > 1 and engine.cluster is not None:
        raise APIError(
            400,
            "n above 1 is not supported when the server runs as a cluster job: send the "
            "choices as separate requests.",
            param="n",
        )
    req = GenerationRequest(
        prompt_tokens=prompt.tokens,
        params=params,
        kind=kind,
        boundaries=prompt.boundaries,
        constraint=constraints[0],
        token_bytes=token_bytes(engine) if want_bytes else None,
        image_spans=prompt.image_spans,
        images=prompt.images,
    )
    req.forks = [fork_of(req, i, constraint) for i, constraint in enumerate(constraints) if i]
    loop = asyncio.get_running_loop()
    for choice in [req, *req.forks]:
        choice.bind(loop)
    try:
        engine.submit(req)
    except EngineBusy:
        message = "The server is busy: the request queue is full."
        raise unavailable(message, overloaded=True) from None
    except EngineNotReady as exc:
        raise unavailable(str(exc)) from None
    except RequestTooLarge as exc:
        field = "prompt" if kind == "text" else "messages"
        raise APIError(400, str(exc), param=field, code="kv_budget_exceeded") from None
    tokenizer = engine.tokenizer
    pool: ModelPool = request.app.state.pool
    release = last_of(len(parsers), lambda: pool.release(slot))  # the lease: once, at the end
    generations = [
        Generation(
            choice,
            parser,
            slot.name,
            lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
            release=release,
            on_done=on_done,
        )
        for choice, parser in zip([req, *req.forks], parsers, strict=True)
    ]
    generations[0].others = generations[1:]
    return generations[0]


def _sampling(
    sampling: Sampling, prompt_tokens: int, context: int | None, kind: str
) -> SamplingParams:
    """Engine sampling parameters; max_tokens is clipped to the room left in the context."""
    room = None if context is None else context - prompt_tokens
    if room is not None and room < 1:
        raise APIError(
            400,
            # Worded as Anthropic words it: Claude Code reads "prompt is too long: N tokens > M"
            # and compacts its history; Codex reads the code.
            f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum (the model's "
            f"context is {context} tokens and the answer needs at least one).",
            param="prompt" if kind == "text" else "messages",
            code="context_length_exceeded",
        )
    limits = [x for x in (sampling.max_tokens, room) if x is not None]
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        max_tokens=min(limits) if limits else DEFAULT_MAX_TOKENS,
        stop=sampling.stop,
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        ignore_eos=sampling.ignore_eos,
        speculative=sampling.speculative,
    )


def unavailable(message: str, *, overloaded: bool = False) -> APIError:
    """A 503 to retry after a moment (`overloaded`: the queue is full, Anthropic's 529)."""
    return APIError(
        503,
        message,
        code="server_unavailable",
        headers={"Retry-After": RETRY_AFTER_SECONDS},
        overloaded=overloaded,
    )
