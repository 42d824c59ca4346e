"""A disk that fills up under a running server, for real: the prompt cache lives on a 16 MiB
tmpfs (needs root and mount rights on Linux; skipped elsewhere), which another file fills in the
middle of a conversation and then gives back.

One server for the module (`--live-budget 0`, so a returning conversation is restored from the
cache, not from live KV). While the disk is full every answer equals the `--no-cache` server's,
the turns checkpointed meanwhile are restored from RAM, the disk budget drops to the space there
is and entries are evicted to fit, `/health` stays 200 and says the disk writes are failing, and
the log says so once. When space returns, the budget grows back, writes resume (one line each),
and after a restart what was written since is restored from disk.

The in-process matrix of every disk step x ENOSPC/EIO/EACCES is in tests/unit
(test_cache_disk_faults.py, test_engine_disk_faults.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.kill_loop import (
    cache_env,
    cache_stats,
    entry_files,
    log_lines,
    temp_files,
    wait_for_writes,
)
from tests.support.servers import ServerProcess
from tests.support.soak_workload import Turn, answer, build_workload, chat

FLAGS = ("--cache-budget", "8MiB", "--live-budget", "0")


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 16 MiB tmpfs, unmounted after the module."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a tmpfs (mount -t tmpfs) is Linux-only")
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small filesystem needs root")
    mnt = tmp_path_factory.mktemp("small-fs")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace')}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture(scope="module")
def disk_server(small_fs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    workdir = tmp_path_factory.mktemp("disk-full")
    proc = ServerProcess(workdir, *FLAGS, env=cache_env(small_fs / "kv"))
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def workload(nocache_server: ServerProcess) -> list[list[Turn]]:
    return build_workload(nocache_server.base_url)


def health(server: ServerProcess) -> dict:
    resp = httpx.get(server.base_url + "/health", timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


def fill(fs: Path, leave: int) -> Path:
    """Another program fills the file system, leaving `leave` bytes free."""
    free = os.statvfs(fs)
    filler = fs / "filler"
    filler.write_bytes(b"\0" * max(0, free.f_bavail * free.f_frsize - leave))
    return filler


def test_a_disk_that_fills_up_keeps_serving_from_ram_then_writes_again(
    disk_server, small_fs, workload, start_server
):
    server, root = disk_server, small_fs / "kv"
    first, other = workload[0], workload[1]
    assert answer(server.base_url, first[0].as_messages()) == first[0].reference
    before = wait_for_writes(server)
    on_disk = len(entry_files(root))
    assert on_disk >= 2 and before["disk_budget"] == 8 << 20 and not before["disk_short"]
    assert health(server)["cache_disk"] == {
        "writes_failing": False,
        "error": None,
        "budget_lowered": False,
        "undeleted_files": 0,
    }

    filler = fill(small_fs, leave=128 * 1024)  # less than any checkpoint of this model
    # Turn 2 of the first conversation: answered, its checkpoints fail to land (RAM only).
    body = chat(server.base_url, first[1].as_messages())
    assert body["choices"][0]["message"]["content"] == first[1].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    turn_two = body["usage"]["prompt_tokens"]
    # Another conversation takes the live KV; the first one then comes back.
    assert answer(server.base_url, other[0].as_messages()) == other[0].reference
    body = chat(server.base_url, first[2].as_messages())
    assert body["choices"][0]["message"]["content"] == first[2].reference
    # Everything turn 2 stored is reused, and it was never on disk: it came from RAM.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= turn_two
    stats = wait_for_writes(server)
    assert stats["write_errors"] >= 1 and stats["disk_writes_failing"]
    assert stats["disk_short"] and stats["disk_budget"] < before["disk_budget"]
    assert stats["disk_bytes"] <= before["disk_bytes"]  # nothing landed; chains kept whole
    assert any(e["disk"] == "none" and e["in_ram"] for e in stats["entries_list"])
    assert temp_files(root) == []
    state = health(server)
    assert state["status"] == "ok" and state["cache_disk"]["writes_failing"]
    assert state["cache_disk"]["error"] == "No space left on device"
    assert state["cache_disk"]["budget_lowered"]
    assert metric(server, "mlx_kvserve_cache_disk_writes_failing") == 1
    # One warning for the episode, not one per request.
    assert len(log_lines(server, "prompt-cache disk write failed")) == 1
    assert len(log_lines(server, "disk budget lowered")) == 1
    warnings = [line for line in server.log().splitlines() if " WARNING " in line]
    assert len([line for line in warnings if "prompt-cache" in line]) == 1

    filler.unlink()  # space returns
    time.sleep(1.1)  # the free space is read again at most once a second while it is short
    for turn in (first[3], other[1], other[2]):
        assert answer(server.base_url, turn.as_messages()) == turn.reference
    stats = wait_for_writes(server)
    assert not stats["disk_writes_failing"] and not stats["disk_short"]
    assert stats["disk_budget"] == 8 << 20 and len(entry_files(root)) > 0
    assert len(log_lines(server, "prompt-cache disk writes resumed")) == 1
    assert len(log_lines(server, "disk space is back")) == 1
    assert not health(server)["cache_disk"]["writes_failing"]
    assert metric(server, "mlx_kvserve_cache_disk_writes_failing") == 0

    # What was written after space returned is a usable cache after a restart.
    assert server.stop() == 0
    again = start_server(*FLAGS, env=cache_env(root))
    assert "dropped" not in again.log()
    body = chat(again.base_url, other[3].as_messages())
    assert body["choices"][0]["message"]["content"] == other[3].reference
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cache_stats(again)["restores_from_disk"] >= 1
