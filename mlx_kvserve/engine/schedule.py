"""Which work the engine runs next: a decode step of the batch, or a chunk of someone's prefill.

Several requests may be prefilling while others decode. Two rules share the machine:

- **Short prefills first, at once.** A prefill that is one pass from the start (the next turn of
  an agent whose history is cached, typically its newest message, or a short new prompt) runs
  before the next chunk of a long one, the shortest first, so a conversation's short turn never
  waits behind another's whole 30k-token prefill. It runs straight away while the prefill
  tokens since the batch's last decode step stay within one chunk: newcomers that arrive
  together are prefilled back to back and then decode together, and the batch never stalls for
  more than one chunk.
- **Decode slices** for long prefills. Before each chunk of a long prefill, the batch decodes
  for at least `decode_share` times the chunk's expected duration (from the seconds per token
  of recent chunks). Running sequences thus keep about half the machine while a newcomer's long
  prompt prefills (share 1), a sequence that has just got its first token is not stalled by
  someone else's chunk straight away, and a short answer finishes within one slice.
- **Long prefills take turns,** a chunk each (round robin), so agents that start together with
  long contexts are ready together and then decode in one batch instead of one after another;
  serving them first come, first served would give the first its answer sooner but leave each
  decoding alone while the next prefills. A request not looked up yet goes first (the lookup is
  cheap and tells how much it has left), and so does a cancelled one (its next advance ends it).
"""

from __future__ import annotations

from collections.abc import Iterator

from mlx_kvserve.engine.chunks import TAIL_FOLD
from mlx_kvserve.engine.generate import PrefillTask

DECODE_SHARE = 1.0  # decode time per unit of prefill time while both have work


class Scheduler:
    """The prefill tasks in flight, and the accounting that decides between them and decode."""

    def __init__(self, chunk_tokens: int, decode_share: float = DECODE_SHARE) -> None:
        self.chunk_tokens = chunk_tokens
        self.one_pass = max(chunk_tokens, TAIL_FOLD)  # a prefill this short ends in one pass
        self.decode_share = decode_share
        self.tasks: list[PrefillTask] = []  # longest since its last chunk first
        self._decoded = 0.0  # seconds the batch has decoded since the last prefill chunk
        self._steps = 0  # decode steps since the last prefill chunk
        self._since_step = 0  # tokens prefilled since the batch's last decode step
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
        if not decoding or self._urgent(task):
            return task
        if self._short(task) and task.remaining <= self.chunk_tokens - self._since_step:
            return task  # at once, within one chunk's stall of the batch
        slice_ = self.decode_share * self._expected_seconds(task)
        if self._steps == 0 or self._decoded < slice_:
            return None  # at least one decode step between two chunks
        return task

    def decoded(self, seconds: float) -> None:
        """The batch ran a decode step of `seconds`."""
        self._decoded += seconds
        self._steps += 1
        self._since_step = 0

    def prefilled(self, task: PrefillTask, tokens: int, seconds: float) -> None:
        """`task` ran a chunk of `tokens` in `seconds`: it goes to the back of the line, and
        the decoders get a new slice."""
        if tokens <= 0:
            return  # a lookup or restore, not a chunk
        self.tasks.remove(task)
        self.tasks.append(task)
        self._since_step += tokens
        self._decoded, self._steps = 0.0, 0
        rate = seconds / tokens
        self._per_token = rate if self._per_token is None else (self._per_token + rate) / 2

    # ------------------------------------------------------------------------------------------
    def _pick(self) -> PrefillTask:
        for task in self.tasks:
            if self._urgent(task):
                return task
        short = [task for task in self.tasks if self._short(task)]
        if short:
            return min(short, key=lambda task: task.remaining)  # first in line of equals
        return self.tasks[0]

    @staticmethod
    def _urgent(task: PrefillTask) -> bool:
        """Not looked up yet (cheap, and tells how much is left), or cancelled (ends at once)."""
        return not task.started or task.req.cancelled.is_set()

    def _short(self, task: PrefillTask) -> bool:
        """One pass from the start: an agent's next turn, or a short new prompt."""
        return task.to_prefill <= self.one_pass

    def _expected_seconds(self, task: PrefillTask) -> float:
        if self._per_token is None:
            return 0.0  # nothing measured yet
        return self._per_token * min(task.remaining, self.chunk_tokens)
