"""Blame what failed, keep what did not (DESIGN invariant 5; engine/blame.py), in process.

The tiny random llama of the engine tests serves, from a prompt cache on disk, two conversations
that share a system prompt. Conversation A's third turn restores a chain of four links (the
system-prompt anchor, A's first answer, the glue after it, A's second answer); conversation B
hangs off the same anchor. Failures are injected where they happen for real: a link whose file
passes every check but prefills non-finite logits (`poison_entry`), and the named fault points
of engine/faults.py (an error nobody expected after or inside a restore, Metal running out of
memory). Every answer must equal mlx-lm's cache-off greedy answer, `cached_tokens` must say what
the successful try reused, and what stays on disk and in the index is checked link by link.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache.kinds import describe_model
from mlx_kvserve.engine import faults
from mlx_kvserve.engine.batch import DecodeBatch
from mlx_kvserve.engine.blame import MEMORY, STATE, UNKNOWN, StateFailed, blame_of
from mlx_kvserve.engine.generate import Generator
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.requests import SamplingParams
from mlx_kvserve.engine.room import Room
from tests.support.cache_testing import poison_entry
from tests.unit.test_engine_units import (
    Recorder,
    StubTokenizer,
    reference,
    tiny_model,
    tokens_of,
)

MiB = 1 << 20
FINGERPRINT = "tiny-blame"
SYSTEM = [(5 * i + 1) % 97 for i in range(24)]
ANSWER = 4  # tokens per answer
A_USERS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34]]
B_USERS = [[41, 42, 43, 44], [51, 52]]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def conversation(model, users: list[list[int]]) -> list[tuple[list[int], dict[int, str]]]:
    """Each turn's prompt and checkpoint boundaries (the system prompt's end is an anchor, the
    end of the conversation before the newest message a "message" point); the answers in the
    history are mlx-lm's own."""
    history, turns = list(SYSTEM), []
    for user in users:
        prompt = history + user
        boundaries = {len(SYSTEM): "anchor"}
        if len(history) > len(SYSTEM):
            boundaries[len(history)] = "message"
        turns.append((prompt, boundaries))
        history = prompt + reference(model, prompt, ANSWER)
    return turns


class Served:
    """A prompt cache on disk and what serves from it; `restart()` is a new process's view."""

    def __init__(self, model, root: Path) -> None:
        self.model = model
        self.root = root
        self.cache = self._open()

    def _open(self) -> PromptCache:
        return PromptCache(self.root, FINGERPRINT, disk_budget=1 << 30, ram_budget=64 * MiB)

    def restart(self) -> None:
        self.cache.close()
        self.cache = self._open()

    def poison(self, key: str) -> None:
        """Damage `key`'s file while the server is down (see `poison_entry`), then start."""
        self.cache.close()
        poison_entry(self.path(key))
        self.cache = self._open()

    def generator(self) -> Generator:
        states = PromptStates(self.model, self.cache)  # no resident session: the cache serves
        return Generator(self.model, StubTokenizer(), states, prefill_step=8, checkpoint_interval=0)

    def ask(self, prompt: list[int], boundaries: dict[int, str]) -> Recorder:
        req = Recorder(list(prompt), params(), "chat", boundaries=dict(boundaries))
        self.generator().run(req)
        assert tokens_of(req.text) == reference(self.model, prompt, ANSWER)  # cache-off answer
        return req

    def indexed(self) -> set[str]:
        self.cache.flush()
        return {e.key for e in self.cache.entries()}

    def files(self) -> set[str]:
        self.cache.flush()
        return {p.name[: -len(".kvc")] for p in (self.root / FINGERPRINT).glob("*.kvc")}

    def path(self, key: str) -> Path:
        return self.root / FINGERPRINT / f"{key}.kvc"


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=ANSWER)


@pytest.fixture
def served(model, tmp_path):
    """A's first two turns and B's two turns served, then a restart: A's third turn restores
    `chain` (root first, as (key, first position)) from disk."""
    a, b = conversation(model, A_USERS), conversation(model, B_USERS)
    served = Served(model, tmp_path / "kv")
    for prompt, boundaries in (a[0], b[0], a[1], b[1]):
        served.ask(prompt, boundaries)
    served.restart()
    match = served.cache.lookup(a[2][0])
    served.chain = served.cache.links(match.key, match.usable)
    served.a, served.b = a, b
    served.before = served.indexed()
    assert served.files() == served.before
    yield served
    served.cache.close()


@pytest.fixture
def fault(monkeypatch):
    """Arm engine/faults.py rules for this test only."""

    def arm(rules: str) -> None:
        monkeypatch.setenv(faults.ENV, rules)
        monkeypatch.setattr(faults, "_rules", None)
        monkeypatch.setattr(faults, "_calls", {})

    return arm


def test_the_chain_under_test(served):
    """Four links, the anchor first; B's links hang off the same anchor."""
    firsts = [first for _, first in served.chain]
    assert firsts[0] == 0 and firsts[1] == len(SYSTEM) and len(firsts) == 4
    assert len(served.before) == 7  # the anchor, A's three links, B's three


# ------------------------------------------------------------------ the state's failures --
def test_a_link_that_prefills_non_finite_logits_costs_only_itself(served, caplog):
    """The measured case: one bad link, the newest. The retry starts from its parent, the
    answer is the cache-off one, and only that link (and what was stored on it) is evicted."""
    newest, first = served.chain[-1]
    served.poison(newest)
    prompt, boundaries = served.a[2]
    with caplog.at_level(logging.WARNING):
        req = served.ask(prompt, boundaries)
    assert req.done.cached_tokens == first  # exactly what the retry reused
    kept = served.before - {newest}
    assert newest not in served.indexed() and kept <= served.indexed() and kept <= served.files()
    stats = served.cache.stats()
    assert stats["failure_evictions"] >= 1 and stats["restore_errors"] == 0
    lines = [r.getMessage() for r in caplog.records if "prompt-cache evicted" in r.getMessage()]
    assert len(lines) == 1 and newest[:16] in lines[0] and "non-finite logits" in lines[0]
    # The restored links that stayed are in RAM again (promoted after the restore).
    in_ram = {e.key for e in served.cache.entries() if e.in_ram}
    assert {key for key, _ in served.chain[:-1]} <= in_ram


def test_a_failure_that_repeats_climbs_one_link_at_a_time(served):
    """The third link is bad: the newest is blamed first, then the third; the try from the
    second succeeds, and the anchor, the second link and conversation B stay."""
    (anchor, _), (second, _), (third, third_first), (newest, _) = served.chain
    served.poison(third)
    req = served.ask(*served.a[2])
    assert req.done.cached_tokens == third_first
    gone = {third, newest}
    assert not gone & served.indexed() and not gone & served.files()
    assert served.before - gone <= served.indexed() and {anchor, second} <= served.files()


def test_climbing_stops_after_three_tries_from_the_cache(served):
    """A bad anchor under three newer links: three links are blamed, then the try is cold;
    what was blamed goes, the anchor (never blamed by this request) stays for now."""
    (anchor, _), *newer = served.chain
    served.poison(anchor)
    req = served.ask(*served.a[2])
    assert req.done.cached_tokens == 0
    gone = {key for key, _ in newer}
    assert not gone & served.indexed() and anchor in served.indexed()
    # The next conversation under that system prompt restores the anchor alone: it is blamed.
    served.ask(SYSTEM + [61, 62, 63], {len(SYSTEM): "anchor"})
    assert anchor not in served.indexed() and anchor not in served.files()


def test_nothing_is_barred_the_same_key_is_stored_again(served):
    """A retried turn whose newest link is bad: once evicted, the very same key is stored again
    by the answer's own checkpoint, from the state the retry computed."""
    a2_prompt, a2_boundaries = served.a[1]
    match = served.cache.lookup(a2_prompt)
    links = served.cache.links(match.key, match.usable)
    newest, first = links[-1]
    served.poison(newest)
    poisoned = served.path(newest).read_bytes()
    req = served.ask(a2_prompt, a2_boundaries)
    assert req.done.cached_tokens == first
    assert newest in served.indexed() and served.path(newest).read_bytes() != poisoned
    assert served.cache.verify() == []
    served.restart()  # and it serves: the same turn again restores all of it
    again = served.ask(a2_prompt, a2_boundaries)
    assert again.done.cached_tokens == len(a2_prompt) - 1


# ------------------------------------------------------- not the state's, or not the cache's --
def test_running_out_of_memory_evicts_nothing_and_tries_again(served, fault, caplog):
    fault("prefill_oom:1")
    prompt, boundaries = served.a[2]
    with caplog.at_level(logging.WARNING):
        req = served.ask(prompt, boundaries)
    assert req.done.cached_tokens == len(served.a[1][0]) + ANSWER - 1  # the whole chain again
    assert served.before <= served.indexed() and served.cache.stats()["failure_evictions"] == 0
    assert any("out of memory" in r.getMessage() for r in caplog.records)


def test_running_out_of_memory_twice_fails_the_request_and_evicts_nothing(served, fault):
    fault("prefill_oom:2")
    req = Recorder(list(served.a[2][0]), params(), "chat", boundaries=dict(served.a[2][1]))
    with pytest.raises(RuntimeError, match="Insufficient Memory"):
        served.generator().run(req)
    assert served.before <= served.indexed() and served.cache.stats()["failure_evictions"] == 0


def test_an_unknown_error_blames_the_newest_link(served, fault):
    fault("prefill_after_restore:1")
    req = served.ask(*served.a[2])
    newest, first = served.chain[-1]
    assert req.done.cached_tokens == first
    assert newest not in served.indexed() and served.before - {newest} <= served.indexed()


def test_an_unknown_error_that_repeats_blames_nothing_more(served, fault):
    """It fails from the chain, then from the newest link's parent, then not cold: only the
    newest link goes (an unknown error is not evidence against the shared links)."""
    fault("prefill_after_restore:2")
    req = served.ask(*served.a[2])
    newest, _ = served.chain[-1]
    assert req.done.cached_tokens == 0
    assert served.indexed() >= served.before - {newest} and newest not in served.indexed()


def test_a_failure_that_also_happens_cold_evicts_nothing(served, fault):
    fault("prefill:9")  # every try, the cold one too
    req = Recorder(list(served.a[2][0]), params(), "chat", boundaries=dict(served.a[2][1]))
    with pytest.raises(faults.InjectedFault):
        served.generator().run(req)
    assert served.before <= served.indexed() and served.before <= served.files()
    assert served.cache.stats()["failure_evictions"] == 0
    fault("")
    served.ask(*served.a[2])  # and the next request is served normally


def test_a_checkpoint_that_fails_costs_only_itself(served, fault):
    """A checkpoint stored during the prefill from the restored chain (the "message" point) and
    after the answer both fail: the answer is normal and from the whole chain, nothing is
    blamed or evicted, and the next turn still finds the chain."""
    fault("checkpoint:2")
    prompt, boundaries = served.a[2]
    req = served.ask(prompt, boundaries)
    assert req.done.cached_tokens == len(served.a[1][0]) + ANSWER - 1  # the whole chain
    assert faults.reached("checkpoint") == 2
    assert served.indexed() == served.before  # neither new checkpoint, nothing evicted
    stats = served.cache.stats()
    assert stats["failure_evictions"] == 0 and stats["refused"] == 2
    fault("")
    assert served.ask(prompt, boundaries).done.cached_tokens == req.done.cached_tokens


# ------------------------------------------------------------------------ inside a restore --
def test_an_unexpected_error_inside_a_restore_blames_the_newest_link(served, fault):
    """Not a `CacheRestoreError` (e.g. a call the platform lacks, in the disk tier): evicted and
    retried from the parent, never a failed request."""
    fault("restore:1")
    req = served.ask(*served.a[2])
    newest, first = served.chain[-1]
    assert req.done.cached_tokens == first
    assert newest not in served.indexed() and served.before - {newest} <= served.indexed()
    assert served.cache.stats()["restore_errors"] == 1


def test_running_out_of_memory_inside_a_restore_evicts_nothing(served, fault):
    fault("restore_oom:1")
    req = served.ask(*served.a[2])
    assert req.done.cached_tokens == len(served.a[1][0]) + ANSWER - 1
    assert served.before <= served.indexed() and served.cache.stats()["failure_evictions"] == 0


# --------------------------------------------------------------------------- a paused request --
def paused(served: Served, prompt: list[int], boundaries: dict[int, str], steps: int = 2):
    """`prompt`'s request paused after `steps` decode steps (its KV checkpointed, then freed):
    (its sequence, the room it waits in, the batch it left, what it ended with)."""
    gen = served.generator()
    req = Recorder(list(prompt), params(), "chat", boundaries=dict(boundaries))
    _, seq = gen.start(req)
    ended: list = []
    batch = DecodeBatch(served.model, ended.append)
    batch.add(seq)
    for _ in range(steps):
        batch.step()
    room = Room(describe_model(served.model).layers, 1 << 30, gen.states, served.cache, 16, True)
    room._pause(seq, batch, 0)
    served.cache.flush()
    return gen, seq, room, batch, ended


def resume_and_finish(served: Served, gen, seq, room, batch, ended) -> Recorder:
    task = room.next_resume(served.model, 8, busy=False)
    assert task is not None
    while not task.advance():
        pass
    batch.add(seq)
    while batch.seqs:
        batch.step()
    gen.finish(ended[0])
    return seq.req


def test_a_paused_request_resumes_past_a_failure_with_the_same_rules(served, fault):
    prompt, boundaries = served.a[2]
    parts = paused(served, prompt, boundaries)
    seq = parts[1]
    pause_key = served.cache.lookup(seq.live.tokens + [0]).key
    fault("prefill:1")  # the resume's first try fails once: blame its newest link, the pause
    req = resume_and_finish(served, *parts)
    assert tokens_of(req.text) == reference(served.model, prompt, ANSWER)
    assert pause_key not in served.indexed() and served.before <= served.indexed()


def test_a_paused_request_that_runs_out_of_memory_resuming_evicts_nothing(served, fault):
    prompt, boundaries = served.a[2]
    parts = paused(served, prompt, boundaries)
    stored = served.indexed()
    fault("prefill_oom:1")
    req = resume_and_finish(served, *parts)
    assert tokens_of(req.text) == reference(served.model, prompt, ANSWER)
    assert stored <= served.indexed() and served.cache.stats()["failure_evictions"] == 0


# ---------------------------------------------------------- a file that cannot be deleted --
def test_an_evicted_file_that_cannot_be_deleted_is_never_indexed_again(served, fault):
    """EACCES on unlink: the link still leaves the index at once (the request is answered from
    its parent), and its file is marked evicted so that the next start deletes it instead of
    serving it (cache/disk.py `delete`)."""
    newest, first = served.chain[-1]
    served.poison(newest)
    fault("disk_unlink_eacces:99")
    req = served.ask(*served.a[2])
    assert req.done.cached_tokens == first and newest not in served.indexed()
    assert served.path(newest).exists()  # there, but no entry any more
    fault("")
    served.restart()
    assert newest not in served.indexed() and not served.path(newest).exists()
    assert served.before - {newest} <= served.indexed()


def test_a_file_that_cannot_be_deleted_never_fails_the_eviction(served, fault, caplog):
    newest, first = served.chain[-1]
    fault("disk_unlink_eio:99")
    with caplog.at_level(logging.WARNING):
        removed = served.cache.evict(newest, "test")
    assert removed == [newest] and newest not in served.indexed()
    assert served.cache.lookup(served.a[2][0]).usable == first
    assert any("could not delete" in r.getMessage() for r in caplog.records)
    assert served.path(newest).exists()


# ------------------------------------------------------------------------ the classification --
@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (StateFailed("non-finite logits"), STATE),
        (MemoryError(), MEMORY),
        (RuntimeError(faults.METAL_OUT_OF_MEMORY), MEMORY),
        (RuntimeError("[metal::malloc] Attempting to allocate 9 bytes which is greater"), MEMORY),
        (RuntimeError("[metal::malloc] Resource limit (499000) exceeded."), MEMORY),
        (OSError(12, "Cannot allocate memory"), MEMORY),
        (faults.InjectedFault("injected fault at prefill"), UNKNOWN),
        (AttributeError("module 'os' has no attribute 'posix_fadvise'"), UNKNOWN),
        (OSError(5, "Input/output error"), UNKNOWN),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v,
)
def test_what_a_failure_is_blamed_on(error, kind):
    assert blame_of(error) == kind


def test_the_cache_s_own_errors_are_the_state_s():
    from mlx_kvserve.cache import CacheRestoreError, EntryFormatError
    from mlx_kvserve.cache.state import StateError

    for error in (CacheRestoreError("k" * 64, "checksum"), EntryFormatError("x"), StateError()):
        assert blame_of(error) == STATE


def test_logits_are_checked_on_every_try(model, tmp_path):
    """A cold prefill that gives non-finite logits fails cleanly (no cache to blame)."""
    served = Served(model, tmp_path / "kv")
    broken = tiny_model()
    broken.model.norm.weight = mx.full(broken.model.norm.weight.shape, float("nan"))
    gen = Generator(broken, StubTokenizer(), PromptStates(broken, served.cache), prefill_step=8)
    req = Recorder(SYSTEM + [1, 2], params(), "chat")
    with pytest.raises(StateFailed):
        gen.run(req)
    assert served.cache.stats()["failure_evictions"] == 0
    served.cache.close()
