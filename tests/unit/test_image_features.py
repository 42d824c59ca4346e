"""The vision encoder's outputs by image digest (cache/features.py), beside a model's prompt cache.

A real `PromptCache` on a temporary directory: what the vision model will call (`get`, `put`),
a restart, damaged files, the disk budget shared with the KV entries, file modes, the stats.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache.features import DIR_NAME, FEATURE_SHARE, SUFFIX
from mlx_kvserve.engine.prompt_state import PromptStates
from tests.unit.test_engine_units import tiny_model

MiB = 1 << 20
FINGERPRINT = "tiny-features"


def digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def features(seed: int, tokens: int = 64, dtype=mx.bfloat16) -> mx.array:
    """What a vision tower returns for one image: a row of features per image token."""
    return mx.random.normal((tokens, 48), key=mx.random.key(seed)).astype(dtype)


def open_cache(path, budget=256 * MiB, fingerprint=FINGERPRINT) -> PromptCache:
    return PromptCache(path, fingerprint, disk_budget=budget, ram_budget=64 * MiB)


def same(a: mx.array | None, b: mx.array) -> bool:
    return a is not None and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


def files(path) -> list:
    return sorted((path / FINGERPRINT / DIR_NAME).glob(f"*{SUFFIX}"))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_round_trip_in_ram_and_across_a_restart(tmp_path, dtype):
    cache = open_cache(tmp_path)
    a, b = features(1, dtype=dtype), features(2, dtype=dtype)
    assert cache.features.get(digest("a")) is None
    cache.features.put(digest("a"), a)
    cache.features.put(digest("b"), b)
    assert same(cache.features.get(digest("a")), a) and same(cache.features.get(digest("b")), b)
    stats = cache.stats()
    assert stats["features_hits"] == 2 and stats["features_misses"] == 1
    assert stats["features_stores"] == 2 and stats["features_ram_entries"] == 2
    cache.close()

    cache = open_cache(tmp_path)  # a restart: nothing in RAM, the files are read back
    assert cache.stats()["features_disk_entries"] == 2
    assert same(cache.features.get(digest("a")), a)
    assert same(cache.features.get(digest("b")), b)
    assert cache.features.get(digest("c")) is None
    stats = cache.stats()
    assert stats["features_disk_hits"] == 2 and stats["features_discarded"] == 0
    cache.clear()  # `mlx-kvserve cache clear` empties them too
    assert files(tmp_path) == [] and cache.features.get(digest("a")) is None
    cache.close()


def test_files_are_private_and_temporary_leftovers_are_swept(tmp_path):
    cache = open_cache(tmp_path)
    cache.features.put(digest("a"), features(1))
    cache.features.flush()
    (path,) = files(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    cache.close()
    leftover = path.parent / f".{path.name}.1234.0.tmp"  # a write a kill cut short
    leftover.write_bytes(path.read_bytes()[:100])
    cache = open_cache(tmp_path)
    assert not leftover.exists() and files(tmp_path) == [path]
    cache.close()


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped payload bit":
        data[-7] ^= 0x10
        path.write_bytes(data)
    elif how == "zero-filled":
        path.write_bytes(bytes(len(data)))
    elif how == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(len(data)))
    elif how == "empty":
        path.write_bytes(b"")


@pytest.mark.parametrize(
    "how", ["truncated", "flipped payload bit", "zero-filled", "random bytes", "empty"]
)
def test_a_damaged_file_is_discarded_never_served(tmp_path, how, caplog):
    cache = open_cache(tmp_path)
    cache.features.put(digest("a"), features(1))
    cache.close()
    (path,) = files(tmp_path)
    damage(path, how)
    cache = open_cache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mlx_kvserve.cache"):
        assert cache.features.get(digest("a")) is None
    assert not path.exists()
    assert cache.stats()["features_discarded"] == 1 and cache.stats()["features_disk_entries"] == 0
    assert [r for r in caplog.records if "discarded the features" in r.getMessage()]
    # The image's features, computed again, are stored again.
    cache.features.put(digest("a"), features(1))
    cache.close()
    cache = open_cache(tmp_path)
    assert same(cache.features.get(digest("a")), features(1))
    cache.close()


def test_a_file_under_another_name_or_of_another_model_is_discarded(tmp_path):
    cache = open_cache(tmp_path)
    cache.features.put(digest("a"), features(1))
    cache.close()
    (path,) = files(tmp_path)
    path.rename(path.with_name(digest("b") + SUFFIX))  # whole and sound, but not b's
    other = tmp_path / "other-model" / DIR_NAME
    other.mkdir(parents=True, mode=0o700)
    (other / (digest("a") + SUFFIX)).write_bytes(b"")
    cache = open_cache(tmp_path)
    assert cache.features.get(digest("b")) is None
    assert cache.stats()["features_discarded"] == 1
    cache.close()
    # Another model's features for the same image: its directory, its fingerprint.
    mine = open_cache(tmp_path)
    mine.features.put(digest("a"), features(1))
    mine.close()
    theirs = open_cache(tmp_path, fingerprint="other-model")
    (their_path,) = sorted(other.glob(f"*{SUFFIX}"))
    their_path.write_bytes((files(tmp_path)[0]).read_bytes())
    assert theirs.features.get(digest("a")) is None  # stamped with the other fingerprint
    theirs.close()


def test_not_a_digest_is_refused():
    cache = PromptCache(None, FINGERPRINT, disk_budget=None, ram_budget=64 * MiB)
    model = tiny_model()
    assert PromptStates(model, cache).features is cache.features  # where the engine finds it
    assert PromptStates(model, cache, enabled=False).features is None  # --no-cache
    for bad in ["../../etc/passwd", "", "A" * 64, "a/b", "ab"]:
        assert cache.features.get(bad) is None
        with pytest.raises(ValueError):
            cache.features.put(bad, features(1))
    cache.features.put(digest("ram only"), features(1))  # no directory: RAM only
    assert same(cache.features.get(digest("ram only")), features(1))


def test_the_disk_budget_holds_the_features_and_the_kv_together(tmp_path):
    """The features keep at most 1/FEATURE_SHARE of the budget (least recently used out); the
    KV entries leave them that room, so the directory stays within the budget."""
    budget = 400_000
    one = len(np.asarray(features(0).view(mx.uint16)).tobytes())  # 6 KiB of bf16 a file
    cache = open_cache(tmp_path, budget=budget)
    assert cache.disk_budget == budget
    names = [digest(f"image {i}") for i in range(12)]
    for i, name in enumerate(names):
        cache.features.put(name, features(i))
        if i == 5:  # seven files fit: image 0 and the six put after this use stay
            assert cache.features.get(names[0]) is not None  # used: the others go first
    cache.features.flush()
    on_disk = {p.name.removesuffix(SUFFIX) for p in files(tmp_path)}
    held = sum(p.stat().st_size for p in files(tmp_path))
    assert held <= budget // FEATURE_SHARE < held + 2 * one
    assert names[0] in on_disk and names[-1] in on_disk and names[1] not in on_disk
    assert cache.stats()["features_evictions"] == len(names) - len(on_disk)
    # KV checkpoints fill the rest of the budget, and no more.
    model = tiny_model()
    tokens = [(7 * i + 3) % 97 for i in range(2000)]
    kv = make_prompt_cache(model)
    model(mx.array([tokens]), cache=kv)
    for n in range(100, 2000, 100):
        cache.checkpoint(tokens[:n], kv, "interval")
        cache.flush()
    kv_bytes = sum(p.stat().st_size for p in (tmp_path / FINGERPRINT).glob("*.kvc"))
    assert kv_bytes > 0 and kv_bytes + held <= budget
    cache.close()


def test_a_failing_disk_loses_only_the_file(tmp_path, monkeypatch, caplog):
    """A write that fails (a full disk) fails no call: the features stay in RAM, the file is
    not counted against the budget, one warning, and the next write goes to disk again."""
    from mlx_kvserve.cache import features as features_module

    real = features_module.replace_file
    failures = iter([True, True])

    def flaky(path, data, mode):
        if next(failures, False):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data, mode)

    monkeypatch.setattr(features_module, "replace_file", flaky)
    cache = open_cache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mlx_kvserve.cache"):
        cache.features.put(digest("a"), features(1))
        cache.features.put(digest("b"), features(2))
        cache.features.flush()
    assert same(cache.features.get(digest("a")), features(1))  # from RAM
    stats = cache.stats()
    assert stats["features_write_errors"] == 2 and stats["features_disk_bytes"] == 0
    assert len([r for r in caplog.records if "could not write" in r.getMessage()]) == 1
    cache.features.put(digest("c"), features(3))
    cache.close()
    assert [p.name for p in files(tmp_path)] == [digest("c") + SUFFIX]


def test_the_memory_ledger_counts_the_features_and_can_free_them(tmp_path):
    """Features in RAM count with the RAM tier (the engine's memory ledger reads it), and a
    request short of memory can have them dropped: their files stay and serve."""
    cache = open_cache(tmp_path)
    before = cache.memory()["ram_tier"]
    a = features(1)
    cache.features.put(digest("a"), a)
    cache.flush()  # the image features' write too
    assert files(tmp_path) and cache.memory()["ram_tier"] == before + a.nbytes
    assert cache.memory()["pending_writes"] == 0
    assert cache.release_ram(cache.memory()["ram_tier"]) >= a.nbytes
    assert cache.memory()["ram_tier"] == 0 and cache.stats()["features_ram_entries"] == 0
    assert same(cache.features.get(digest("a")), a)  # from its file
    assert cache.stats()["features_disk_hits"] == 1
    cache.limit_ram(0.0)  # the system is short of memory: no RAM for features either
    assert cache.stats()["features_ram_bytes"] == 0
    cache.features.put(digest("b"), features(2))
    assert cache.stats()["features_ram_bytes"] == 0
    cache.limit_ram(1.0)
    assert same(cache.features.get(digest("b")), features(2))
    assert cache.stats()["features_ram_bytes"] == features(2).nbytes
    cache.close()


def test_features_whose_write_has_not_landed_are_served_from_their_copy(tmp_path, monkeypatch):
    from mlx_kvserve.cache import features as features_module

    real, landed = features_module.replace_file, threading.Event()

    def slow(path, data, mode):
        landed.wait(30)
        real(path, data, mode)

    monkeypatch.setattr(features_module, "replace_file", slow)
    cache = open_cache(tmp_path)
    cache.limit_ram(0.0)  # nothing stays in RAM
    a = features(1)
    cache.features.put(digest("a"), a)
    assert cache.memory()["pending_writes"] == a.nbytes  # the queued copy counts
    assert same(cache.features.get(digest("a")), a) and files(tmp_path) == []
    landed.set()
    cache.close()
    cache = open_cache(tmp_path)
    assert same(cache.features.get(digest("a")), a)
    cache.close()


def test_a_file_deleted_behind_its_back_is_a_plain_miss(tmp_path):
    cache = open_cache(tmp_path)
    cache.features.put(digest("a"), features(1))
    cache.close()
    cache = open_cache(tmp_path)
    files(tmp_path)[0].unlink()  # `rm` by hand while the server runs
    assert cache.features.get(digest("a")) is None
    stats = cache.stats()
    assert stats["features_discarded"] == 0 and stats["features_disk_entries"] == 0
    cache.close()
