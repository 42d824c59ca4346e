"""Prefill and decode for one request, on the engine thread.

Prefill starts after whatever prefix `PromptStates` could reuse and runs in chunks of
`prefill_step` tokens, as a task the engine resumes chunk by chunk (`PrefillTask`), so other
requests' chunks and decode steps run in between; it checks for cancellation before every
chunk. Earlier chunks evaluate only the KV state, so MLX's lazy graph never runs the vocabulary
projection for them (except at a checkpoint, whose last logits row is kept as a behaviour probe).

Checkpoints (why these boundaries):
- "anchor": the end of the system prompt, shared by every conversation that uses it;
- "message": the end of the conversation before its newest message, so an edited or retried
  last message, or a branch, restarts from there;
- "interval": every `checkpoint_interval` tokens of a long prefill, so a disconnect or crash
  midway loses at most one interval of work;
- "prompt": where the next turn will depart from this prompt when its template re-renders the
  answer differently (past reasoning stripped), and a retry of the same request: the chat layer
  places it before a `<think>` the generation prompt opens; otherwise it is one token before
  the prompt's end (a lookup always leaves one token to prefill), kept only for caches that
  cannot be trimmed (rotating, SSM), since trimmable ones are cut back from the "generation"
  checkpoint;
- "generation": prompt plus completion after the answer, which the next turn resends;
- "partial": whatever was prefilled when the client went away.
With delta storage each checkpoint writes only the tokens it adds beyond its parent.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from collections.abc import Generator as Generator_

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_kvserve.cache.state import is_sliceable
from mlx_kvserve.engine import faults, image_prefill
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.blame import check_logits, recover
from mlx_kvserve.engine.chunks import Checkpoints, plan_chunks
from mlx_kvserve.engine.decode import Cancelled
from mlx_kvserve.engine.live import Live, Timings
from mlx_kvserve.engine.namespaces import States
from mlx_kvserve.engine.positions import Shift
from mlx_kvserve.engine.prompt_state import PromptStates, Start
from mlx_kvserve.engine.requests import Done, GenerationRequest, Prefilled
from mlx_kvserve.engine.sequence import Sequence
from mlx_kvserve.engine.speculation.mtp import chunk_hidden, prefill_source, untap
from mlx_kvserve.vocabulary import vocabulary_size

Result = tuple[Timings, "Sequence | None"]  # a prefill's end: its timings, the sequence or None


def prefill_steps(
    model: nn.Module,
    live: Live,
    prompt: list[int],
    step: int,
    checkpoints: Checkpoints,
    check: Callable[[], None],
    images: image_prefill.ImageRows | None = None,
) -> Iterator[int]:
    """Feed prompt[len(live.tokens):] into the caches, a chunk per resumption.

    Before each chunk it yields the number of prompt tokens still to prefill, so the engine can
    run other work (decode steps, another request's chunk) in between; it returns the last
    position's logits (`logits = yield from prefill_steps(...)`). `check()` runs after every
    resumption: it raises to abandon the prefill (a cancelled request). `images`: the
    prompt's images, fed as embeddings (engine/image_prefill.py).
    """
    start, end = len(live.tokens), len(prompt)
    foldable = checkpoints.sliceable and is_sliceable(live.caches)
    checkpoints = checkpoints.for_prompt(start, end, foldable)
    # `checkpoints` carries the prompt's image spans: no chunk ends, and no checkpoint is
    # taken, inside an image (engine/chunks.py)
    chunks, last_from = plan_chunks(start, end, step, checkpoints, foldable=foldable)
    for lo, hi in chunks:
        yield end - lo
        check()
        faults.maybe_fail("prefill_chunk")
        untap(model)
        out = image_prefill.forward(model, prompt, lo, hi, live.caches, images)
        reason = checkpoints.reason_at(hi)
        last = out[:, -1, :] if reason else None
        fed = _mtp(model, live, prompt, lo, hi)  # its MTP step runs in the same evaluation
        mx.eval([c.state for c in live.caches] + ([last] if reason else []) + fed)
        live.tokens.extend(prompt[lo:hi])
        if reason:
            checkpoints.store(live, last, reason=reason)
    yield end - last_from
    check()
    faults.maybe_fail("prefill_chunk")
    faults.maybe_fail("prefill")
    untap(model)
    out = image_prefill.forward(model, prompt, last_from, end, live.caches, images)
    mx.eval([out] + _mtp(model, live, prompt, last_from, end))
    live.tokens.extend(prompt[last_from:end])
    for position in range(last_from + 1, end):  # checkpoints folded into the last pass
        reason = checkpoints.reason_at(position)
        if reason:
            row = out[:, position - last_from - 1, :]
            checkpoints.store(live, row, reason=reason, length=position)
    return out[:, -1, :]


def _mtp(model: nn.Module, live: Live, prompt: list[int], lo: int, hi: int) -> list[mx.array]:
    """The row's MTP source fed the pass over prompt[lo:hi] (what to evaluate with it)."""
    if live.mtp is None:
        return []
    return live.mtp.chunk(lo, prompt[lo:hi], chunk_hidden(model, live.caches))


class PrefillTask:
    """One request's prefill, advanced a chunk at a time by the engine (engine/schedule.py).

    `remaining` is the number of prompt tokens still to prefill (the whole prompt until the
    first `advance()` has looked up the cache), `to_prefill` what the lookup left; `result` is
    (timings, sequence or None) once `advance()` has returned True. `seconds` adds up the time
    of its own chunks only, so the log line's prefill speed is the model's, whatever ran in
    between.
    """

    def __init__(self, req: GenerationRequest, steps: Generator_[int, None, Result]) -> None:
        self.req = req
        self.remaining = self.to_prefill = len(req.prompt_tokens)
        self.started = False
        self.seconds = 0.0
        self.result: Result | None = None
        self._steps = steps

    def advance(self) -> bool:
        """Run up to the next chunk boundary (the first call: the cache lookup and restore);
        True once the prefill has ended, with `result` set."""
        t0 = time.perf_counter()
        try:
            self.remaining = next(self._steps)
            if not self.started:
                self.to_prefill = self.remaining
            return False
        except StopIteration as stop:
            self.result = stop.value
            self.remaining = 0
            return True
        finally:
            self.started = True
            self.seconds += time.perf_counter() - t0
            if self.result is not None:
                self.result[0].prefill_seconds = self.seconds


def _nothing(*_args: object) -> None:
    return None


class Generator:
    """Runs requests on the engine thread with the model, tokenizer and prompt states.

    `after_prefill(prefilled, restored)` runs once a prompt is in the KV cache (the engine's
    memory policy); `before_done(request, timings)` sees a finished request just before its
    Done event, so a client that has its answer also sees it in the metrics. `between_steps`
    runs between the prefill chunks and decode steps of `run()` and `start()` (scripts and
    tests; the engine schedules those itself). `sliceable` False: some rank of the job cannot
    cut its caches, so every rank plans its chunks as if its own could not (`Checkpoints`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        states: States,
        *,
        prefill_step: int = 512,
        checkpoint_interval: int = 2048,
        sliceable: bool = True,
        after_prefill: Callable[[int, bool], None] = _nothing,
        before_done: Callable[[GenerationRequest, Timings | None], None] = _nothing,
        between_steps: Callable[[], None] = _nothing,
        speculation: str = "off",
        vision: image_prefill.VisionRows | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.vocab = vocabulary_size(tokenizer)  # logits past it are padding: never drawn
        self.states = states
        self.prefill_step = prefill_step
        self.checkpoint_interval = checkpoint_interval
        self.sliceable = sliceable
        self.after_prefill = after_prefill
        self.before_done = before_done
        self.between_steps = between_steps
        self.speculation = speculation  # for `run`'s batch (the engine makes its own)
        self.vision = vision  # a vision model's tower: prompts' images as embeddings

    def run(self, req: GenerationRequest) -> Timings:
        """Generate for `req` alone (scripts, tests): prefill it, decode it in a batch of one."""
        ended: list[Sequence] = []
        timings, seq = self.start(req)
        if seq is None:
            return timings
        batch = DecodeBatch(self.model, ended.append, speculation=self.speculation)
        for row in [seq, *seq.forks]:
            batch.add(row)
        seq.forks = []
        while batch.seqs:
            self.between_steps()
            batch.step()
        for row in ended:
            self.finish(row)
        return timings

    def start(self, req: GenerationRequest) -> Result:
        """Prefill `req` to the end (`between_steps` between its chunks): (timings, the
        sequence to decode, or None if it ended here)."""
        task = self.begin(req)
        while not task.advance():
            self.between_steps()
        assert task.result is not None
        return task.result

    def begin(self, req: GenerationRequest) -> PrefillTask:
        """The prefill of `req`, to be advanced chunk by chunk (see `PrefillTask`)."""
        return PrefillTask(req, self._prefill(req))

    def _prefill(self, req: GenerationRequest) -> Generator_[int, None, Result]:
        """Prefill `req` (from reused state first, tried again as engine/blame.py decides if
        that fails) and sample its first token; returns the sequence to decode, or None if it
        ended here (its Done is sent)."""
        states = self.states.select(req.namespace)
        timings = Timings(prompt_tokens=len(req.prompt_tokens))
        try:
            if req.cancelled.is_set():  # gone before its turn came: no lookup, no restore
                raise Cancelled
            seq = yield from recover(
                states,
                req.prompt_tokens,
                f"request {req.request_id}",
                lambda start: self._attempt(req, timings, states, start),
                timings,
                req.image_spans,
                self.rope_shift(req),
            )
            return timings, seq
        except Cancelled:
            timings.finish_reason = "cancelled"
            self._done(req, timings)
            return timings, None

    def finish(self, seq: Sequence) -> None:
        """A sequence left the batch: its Done, then (so the client never waits for it) its
        after-generation checkpoint, or the partial one of a cancelled request. A fork (choice
        1 and up of an `n` request) stores nothing: one choice's output extends the cache's
        chain, as if the request had had only it."""
        self._done(seq.req, seq.timings)
        if seq.req.choice:
            return
        if seq.finish == "cancelled":
            self._save(seq.states, seq.live, None, reason="partial")
        else:
            self._save(seq.states, seq.live, seq.last_logits, reason="generation")

    def _done(self, req: GenerationRequest, timings: Timings) -> None:
        self.before_done(req, timings)
        req.emit(
            Done(
                finish_reason=timings.finish_reason,
                prompt_tokens=timings.prompt_tokens,
                completion_tokens=timings.completion_tokens,
                cached_tokens=timings.cached_tokens,
                stop_sequence=timings.stop_sequence,
            )
        )

    def _attempt(
        self, req: GenerationRequest, timings: Timings, states: PromptStates, start: Start
    ) -> Generator_[int, None, Sequence]:
        """One try at the prefill from `start`; returns the sequence, first token sampled."""
        prompt = req.prompt_tokens
        live = Live(start.caches, list(start.tokens), req.image_spans)
        if start.mtp is not None and req.params.speculative:
            live.mtp = start.mtp  # a resident session's: the whole conversation's pairs
        else:  # with the pairs the restored entry kept, if it kept them
            speculative = req.params.speculative
            live.mtp = prefill_source(self.model, live.tokens, speculative, start.restored_mtp)
        timings.cached_tokens, timings.cache_source = start.usable, start.source
        timings.restore_seconds = start.restore_seconds

        def check() -> None:
            if req.cancelled.is_set():
                self._save(states, live, None, reason="partial")
                raise Cancelled

        def store(live: Live, last_logits: mx.array | None, **kwargs) -> None:
            self._save(states, live, last_logits, **kwargs)

        checkpoints = Checkpoints(
            req.boundaries,
            self.checkpoint_interval,
            store,
            keep_end=req.kind == "chat",
            sliceable=self.sliceable,
            spans=req.image_spans,
        )
        if start.usable:
            faults.maybe_fail("prefill_after_restore")
        logits = yield from prefill_steps(
            self.model, live, prompt, self.prefill_step, checkpoints, check, self.images(req)
        )
        check_logits(logits)
        self.after_prefill(len(prompt) - start.usable, start.source in ("ram", "disk"))
        req.emit(Prefilled(len(prompt), start.usable))
        seq = Sequence(req, self.tokenizer, live, logits, timings, states, self.vocab)
        seq.rope_delta = self.rope_delta(req)
        seq.forks = [self._fork(fork, live, logits, states) for fork in req.forks]
        return seq

    def images(self, req: GenerationRequest) -> image_prefill.ImageRows | None:
        """What prefills `req`'s images, if it has any and the model sees them."""
        return image_prefill.request_rows(self.vision, self.model, req.image_spans, req.images)

    def rope_delta(self, req: GenerationRequest) -> int:
        """How far `req`'s decode positions sit from its token count (Qwen's M-RoPE after an
        image; 0 otherwise): its row adds it to its offset in every pass (engine/positions.py)."""
        if self.vision is None or not req.image_spans:
            return 0
        return self.vision.rope_delta(req.image_spans, req.images)

    def rope_shift(self, req: GenerationRequest) -> Shift | None:
        """The rope shift at each position of `req`'s prompt: the images wholly before it
        (a restored entry's probe runs there), None where every position's is 0."""
        if not self.rope_delta(req):
            return None
        vision, pairs = self.vision, list(zip(req.image_spans, req.images, strict=True))
        assert vision is not None

        def shift(pos: int) -> int:
            before = [(s, i) for s, i in pairs if s.start + s.length <= pos]
            return vision.rope_delta([s for s, _ in before], [i for _, i in before])

        return shift

    def _fork(
        self, req: GenerationRequest, live: Live, logits: mx.array, states: PromptStates
    ) -> Sequence:
        """Another choice of a prefilled request: its own row, on a copy of the prompt's KV
        (rows of a batch grow apart, and a solo row updates its caches in place). Its timings
        count no prompt tokens: the request's prompt is counted once, with choice 0."""
        caches = copy.deepcopy(live.caches)
        timings = Timings(cache_source="fork")
        req.emit(Prefilled(len(req.prompt_tokens), len(req.prompt_tokens)))
        forked = Live(caches, list(live.tokens), live.spans)
        if live.mtp is not None and req.params.speculative:
            forked.mtp = live.mtp.copy()
        seq = Sequence(req, self.tokenizer, forked, logits, timings, states, self.vocab)
        seq.rope_delta = self.rope_delta(req)
        return seq

    def _save(
        self,
        states: PromptStates,
        live: Live,
        last_logits: mx.array | None,
        *,
        reason: str,
        length: int | None = None,
    ) -> None:
        """Checkpoint the first `length` (default: all) live tokens if the cache is on, under
        their key (`Live.key`); after a generation or a disconnect, keep the live caches as a
        resident session."""
        cache = states.cache
        tokens = live.key(length)
        # the row's MTP source over exactly the caches' tokens (a finished row's may hold its
        # last sampled token too, or lag behind them): the entry keeps its state of the
        # checkpoint's tokens; a prefill's is fed its tokens as they come
        mtp = live.mtp
        if mtp is not None and reason in {"generation", "partial"}:
            mtp = mtp.cut(live.tokens)
        if cache is not None and tokens:
            anchor = reason == "anchor"
            state = mtp.state(len(tokens)) if mtp is not None else None
            cache.checkpoint(
                tokens, live.caches, reason, anchor=anchor, probe=last_logits, mtp=state
            )
        if reason in {"generation", "partial"} and (held := live.key()) is not None:
            states.keep(held, live.caches, mtp)
