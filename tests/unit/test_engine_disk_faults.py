"""Disk faults under a real engine: a conversation on the tiny llama of the cache tests, its
prompt cache on disk, and each disk step (write, fsync, rename, directory fsync; header read,
payload read, read-ahead; unlink) failing with ENOSPC, EIO or EACCES in the middle of it.

Every turn must end with mlx-lm's own greedy answer (the cache-off answer): a failed write loses
only its checkpoint (the next turn starts from a shorter prefix), a failed read is a miss of that
chain (the turn is served cold), a file that cannot be deleted is never served again. After each
turn the disk and the cache's bookkeeping agree (`assert_disk_consistent`), the next request is
served, and after a restart the cache serves from what is on disk.
"""

from __future__ import annotations

import errno

import pytest

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache import restore as restore_module
from mlx_kvserve.engine import faults
from mlx_kvserve.engine.generate import Generator
from mlx_kvserve.engine.prompt_state import PromptStates
from mlx_kvserve.engine.requests import SamplingParams
from tests.support.cache_testing import assert_disk_consistent, inject_faults, settle
from tests.unit.test_engine_units import Recorder, StubTokenizer, reference, tiny_model, tokens_of

MiB = 1 << 20
ANSWER = 6
SYSTEM = [(5 * i + 1) % 97 for i in range(16)]
ERRNOS = {"enospc": errno.ENOSPC, "eio": errno.EIO, "eacces": errno.EACCES}
# (op, link size): "large" links are read straight into the caches (header, then payload),
# "small" ones whole in one read, after a read-ahead hint for the chain.
CASES = [
    ("write", "small"),
    ("fsync", "small"),
    ("rename", "small"),
    ("dirsync", "small"),
    ("header", "large"),
    ("read", "small"),
    ("read", "large"),
    ("prefetch", "small"),
    ("unlink", "small"),
]
WRITES = {"write", "fsync", "rename", "dirsync"}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def user(k: int) -> list[int]:
    return [(11 * i + 7 * k + 2) % 97 for i in range(8)]


class Conversation:
    """Turns of one conversation; the live state is dropped before each, so every turn
    starts from the prompt cache (on disk: its RAM tier is off)."""

    def __init__(self, model, cache: PromptCache) -> None:
        self.model = model
        self.history = list(SYSTEM)
        self.use(cache)

    def use(self, cache: PromptCache) -> None:
        self.cache = cache
        self.gen = Generator(
            self.model,
            StubTokenizer(),
            PromptStates(self.model, cache),
            prefill_step=8,
            checkpoint_interval=0,
        )

    def turn(self, k: int) -> Recorder:
        prompt = self.history + user(k)
        self.gen.states.reset()
        req = Recorder(
            prompt,
            SamplingParams(temperature=0.0, max_tokens=ANSWER),
            "chat",
            boundaries={len(SYSTEM): "anchor"},
        )
        self.gen.run(req)
        answer = tokens_of(req.text)
        assert answer == reference(self.model, prompt, ANSWER)  # the cache-off answer
        assert req.done.finish_reason == "length"
        self.history = prompt + answer
        return req


def open_cache(path) -> PromptCache:
    return PromptCache(path, "tiny-disk-faults", disk_budget=64 * MiB, ram_budget=0)


@pytest.mark.parametrize("name", list(ERRNOS))
@pytest.mark.parametrize(("op", "links"), CASES)
def test_every_turn_ends_with_the_cache_off_answer(model, tmp_path, monkeypatch, op, links, name):
    if links == "large":
        monkeypatch.setattr(restore_module, "SMALL_LINK_BYTES", 0)
    cache = open_cache(tmp_path)
    conv = Conversation(model, cache)
    conv.turn(1)
    settle(cache)
    point = f"disk_{op}_{name}"
    # An unlink fails when a failure evicts: here a prefill that fails after the restore.
    inject_faults(monkeypatch, f"prefill_after_restore:1,{point}:100" if op == "unlink" else point)
    second = conv.turn(2)
    stats = assert_disk_consistent(cache)
    assert faults.reached(point) >= 1
    first_turn = len(SYSTEM) + len(user(1)) + ANSWER
    turn_two = len(conv.history)
    if op in WRITES:  # the restore was fine; only the turn's own checkpoint is lost
        assert second.done.cached_tokens >= first_turn - 1
        assert stats["write_errors"] == 1 and stats["failure_evictions"] == 0
    elif op == "prefetch":  # a lost hint: everything was restored
        assert second.done.cached_tokens >= first_turn - 1
        assert stats["failure_evictions"] == 0 and stats["restores_from_disk"] >= 2
    elif op == "unlink":  # the newest link blamed, retried from the anchor; its file stays,
        # marked, and is never used
        assert second.done.cached_tokens == len(SYSTEM) and stats["undeleted_files"] >= 1
    else:  # the chain could not be read: a miss, served cold
        assert second.done.cached_tokens == 0 and stats["failure_evictions"] >= 1
    inject_faults(monkeypatch, "")
    third = conv.turn(3)  # the next request is served, from what the cache kept
    if op in WRITES:
        assert first_turn - 1 <= third.done.cached_tokens < turn_two - 1  # a shorter prefix
    else:
        assert third.done.cached_tokens >= turn_two - 1
    assert_disk_consistent(cache)
    cache.close()
    cache = open_cache(tmp_path)  # a restart: only whole, unevicted entries come back
    assert cache.disk.undeleted == {} and cache.stats()["suspect"] == 0
    conv.use(cache)
    before = len(conv.history)
    assert conv.turn(4).done.cached_tokens >= before - 1
    assert_disk_consistent(cache)
    cache.close()
