"""The prompt cache across the ranks of a job: every rank keeps its own slice of each
checkpoint (engine/job_states.py). A restarted job restores from every rank's disk; a damaged
slice on one rank is a miss on all; a slice that fails only after it is restored is blamed
alike on every rank; rank 0's disk budget decides what every rank evicts."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from mlx_kvserve.cache import PromptCache
from tests.support.cache_testing import poison_entry
from tests.support.cluster_jobs import (
    client,
    conversation,
    start_job,
)

pytestmark = pytest.mark.slow


def test_every_rank_keeps_its_slice_and_a_restarted_job_restores_from_disk(
    job_models, llama_alone, tmp_path
):
    cache = str(tmp_path / "cache")
    args = ("--model", str(job_models["llama"]), "--cache-dir", cache)
    job = start_job(tmp_path, 2, *args)
    first = conversation(job, 2)
    assert job.stop() == 0 and job.exit_codes() == {}
    slices = sorted(p.name.split("-", 2)[2] for p in Path(cache).iterdir())
    assert slices == ["tensor-2r0", "tensor-2r1"]  # one cache per rank, named by the layout
    assert all(list((Path(cache) / p).glob("*.kvc")) for p in os.listdir(cache))

    job = start_job(tmp_path, 2, *args)
    try:
        again = conversation(job, 3)
        expected = [text for text, _ in conversation(llama_alone, 3)]
        assert [text for text, _ in again] == expected
        assert [text for text, _ in first] == expected[:2]
        assert again[0][1] > 0 and again[1][1] > again[0][1], again  # from disk, every rank
        assert "cache=disk" in job.log()
    finally:
        job.stop()


def test_rank_0s_disk_budget_decides_what_every_rank_evicts(job_models, tmp_path):
    cache = tmp_path / "cache"
    args = (
        "--model",
        str(job_models["llama"]),
        "--cache-dir",
        str(cache),
        "--cache-budget",
        "256KiB",
    )
    job = start_job(tmp_path, 2, *args)
    try:
        for topic in range(8):  # different conversations, more than the budget holds
            reply = client(job).chat.completions.create(
                model="llama",
                messages=[
                    {"role": "system", "content": f"Topic {topic}. " + "Be brief. " * 40},
                    {"role": "user", "content": "Go on."},
                ],
                max_tokens=8,
                temperature=0,
            )
            assert reply.choices[0].message.content
        evictions = httpx.get(job.base_url + "/v1/cache").json()["evictions"]
        assert evictions > 0
    finally:
        job.stop()
    kept = {}
    for directory in cache.iterdir():
        stored = PromptCache(cache, directory.name, disk_budget=None, ram_budget=0, read_only=True)
        kept[directory.name[-3:]] = sorted((e.n_tokens, e.reason) for e in stored.entries())
        stored.close()
    assert kept["2r0"] and kept["2r0"] == kept["2r1"], kept


def test_a_damaged_slice_on_one_rank_is_a_miss_on_every_rank(job_models, llama_alone, tmp_path):
    cache = tmp_path / "cache"
    args = ("--model", str(job_models["llama"]), "--cache-dir", str(cache))
    job = start_job(tmp_path, 2, *args)
    conversation(job, 2)
    job.stop()
    (rank_1,) = [p for p in cache.iterdir() if p.name.endswith("-2r1")]
    for path in rank_1.glob("*.kvc"):  # every checkpoint of rank 1's slice
        data = bytearray(path.read_bytes())
        data[-150:-100] = bytes(b ^ 0x5A for b in data[-150:-100])
        path.write_bytes(bytes(data))

    job = start_job(tmp_path, 2, *args)
    try:
        again = conversation(job, 2)
        assert [text for text, _ in again] == [text for text, _ in conversation(llama_alone, 2)]
        assert again[0][1] == 0  # a miss on rank 0 too, though its own slice is sound
        log = job.log()
        assert "payload checksum mismatch" in log
        assert "another rank of the job could not restore its slice" in log
    finally:
        job.stop()


def _stored(cache: Path) -> dict[str, list[tuple[int, str, str]]]:
    """Per rank ("2r0", "2r1"): (tokens, reason, file name) of every entry, shortest first."""
    kept = {}
    for directory in cache.iterdir():
        stored = PromptCache(cache, directory.name, disk_budget=None, ram_budget=0, read_only=True)
        kept[directory.name[-3:]] = sorted((e.n_tokens, e.reason, e.key) for e in stored.entries())
        stored.close()
    return kept


def test_a_slice_that_fails_after_restoring_is_blamed_alike_on_every_rank(
    job_models, llama_alone, tmp_path
):
    """Rank 1's newest link passes every check but prefills non-finite logits (the logits are
    summed across the ranks, so every rank sees them): every rank blames its own newest link,
    tries again from the link before it and evicts alike; the answers are the job-less ones."""
    cache = tmp_path / "cache"
    args = ("--model", str(job_models["llama"]), "--cache-dir", str(cache))
    job = start_job(tmp_path, 2, *args)
    conversation(job, 2)
    job.stop()
    before = _stored(cache)
    tokens, _, newest = before["2r1"][-1]  # turn 2's answer
    (rank_1,) = [p for p in cache.iterdir() if p.name.endswith("-2r1")]
    poison_entry(rank_1 / f"{newest}.kvc")
    poisoned = (rank_1 / f"{newest}.kvc").read_bytes()

    job = start_job(tmp_path, 2, *args)
    try:
        again = conversation(job, 2)  # turn 2 again restores the poisoned link
        expected = [text for text, _ in conversation(llama_alone, 2)]
        assert [text for text, _ in again] == expected
        log = job.log()
        blamed = [ln for ln in log.splitlines() if "prompt-cache evicted" in ln]
        assert len(blamed) == 2 and all("non-finite logits" in ln for ln in blamed), blamed
        assert 0 < again[1][1] < tokens  # from the link before the one blamed
    finally:
        job.stop()
    after = _stored(cache)
    shapes = {rank: [(n, reason) for n, reason, _ in entries] for rank, entries in after.items()}
    assert shapes["2r0"] == shapes["2r1"], after  # evicted (and stored again) alike
    assert (rank_1 / f"{newest}.kvc").read_bytes() != poisoned  # stored again, sound
