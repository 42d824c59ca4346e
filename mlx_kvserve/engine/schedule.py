"""Which work the engine runs next: a decode step of the batch, or a chunk of someone's prefill.

Several requests may be prefilling while others decode. Two rules share the machine:

- **Decode slices.** While some sequences decode and others wait to prefill, the batch decodes
  for at least `decode_share` times the expected duration of the next prefill chunk before that
  chunk runs (expected from the seconds per token of recent chunks). Running sequences thus
  keep about half the machine while a newcomer prefills (share 1), a sequence that has just got
  its first token is not stalled by someone else's chunk straight away, and a short answer
  finishes in one slice. No decode stalls for more than one chunk, and no prefill waits for
  more than one slice.
- **Short prefills first.** A prefill that ends within one chunk (the next turn of an agent
  whose history is cached: typically its newest message) runs before the next chunk of a long
  one, so a conversation's short turn never waits behind another's whole 30k-token prefill.
  Otherwise the oldest runs. A request not looked up yet goes first (the lookup is cheap and
  tells how much it has left), and so does a cancelled one (its next advance ends it).
"""

from __future__ import annotations

from collections.abc import Iterator

from mlx_kvserve.engine.generate import TAIL_FOLD, PrefillTask

DECODE_SHARE = 1.0  # decode time per unit of prefill time while both have work


class Scheduler:
    """The prefill tasks in flight, and the accounting that decides between them and decode."""

    def __init__(self, chunk_tokens: int, decode_share: float = DECODE_SHARE) -> None:
        self.chunk_tokens = chunk_tokens
        self.one_pass = max(chunk_tokens, TAIL_FOLD)  # a prefill this short ends in one pass
        self.decode_share = decode_share
        self.tasks: list[PrefillTask] = []  # oldest first
        self._decoded = 0.0  # seconds the batch has decoded since the last prefill chunk
        self._steps = 0  # decode steps since the last prefill chunk
        self._per_token: float | None = None  # seconds per prefilled token, recent chunks

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[PrefillTask]:
        return iter(list(self.tasks))

    def add(self, task: PrefillTask) -> None:
        self.tasks.append(task)

    def remove(self, task: PrefillTask) -> None:
        self.tasks.remove(task)

    def choose(self, decoding: bool) -> PrefillTask | None:
        """The prefill task to advance now, or None: run a decode step (if anyone decodes)."""
        if not self.tasks:
            return None
        task = self._pick()
        if not decoding or not task.started or task.req.cancelled.is_set():
            return task
        slice_ = self.decode_share * self._expected_seconds(task)
        if self._steps == 0 or self._decoded < slice_:
            return None  # at least one decode step between two chunks
        return task

    def decoded(self, seconds: float) -> None:
        """The batch ran a decode step of `seconds`."""
        self._decoded += seconds
        self._steps += 1

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill chunk of `tokens` took `seconds`: a new slice for the decoders."""
        if tokens <= 0:
            return  # a lookup or restore, not a chunk
        self._decoded, self._steps = 0.0, 0
        rate = seconds / tokens
        self._per_token = rate if self._per_token is None else (self._per_token + rate) / 2

    # ------------------------------------------------------------------------------------------
    def _pick(self) -> PrefillTask:
        for task in self.tasks:
            if not task.started or task.req.cancelled.is_set():
                return task
        for task in self.tasks:
            if task.remaining <= self.one_pass:
                return task
        return self.tasks[0]

    def _expected_seconds(self, task: PrefillTask) -> float:
        if self._per_token is None:
            return 0.0  # nothing measured yet
        return self._per_token * min(task.remaining, self.chunk_tokens)
