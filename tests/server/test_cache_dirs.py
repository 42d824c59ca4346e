"""Cache directories: an unusable one degrades to RAM, a shared one keeps its permissions, and
cache files never live where another user could swap them."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlx_kvserve import paths
from mlx_kvserve.cache import PromptCache
from mlx_kvserve.cache.dirs import UnsafeCacheDirectory, private_subdir
from mlx_kvserve.startup import open_or_degrade

FP = "test-fingerprint"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A directory this process cannot write: immutable (chattr +i), or 0500 when not root."""
    path = tmp_path / "ro"
    path.mkdir()
    immutable = (
        shutil.which("chattr")
        and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    )
    if not immutable:
        if os.geteuid() == 0:
            pytest.skip("root without chattr: no directory is read-only to us")
        path.chmod(0o500)
    yield path
    if immutable:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o700)


def test_read_only_cache_dir_runs_without_disk_tier(start_server, read_only_dir):
    srv = start_server("--cache-dir", str(read_only_dir))
    reply = httpx.post(
        srv.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert reply.status_code == 200
    assert srv.stop(signal.SIGTERM) == 0
    log = srv.log()
    assert log.count("is not usable") == 1, log
    assert "Traceback" not in log
    assert "Application shutdown failed" not in log
    assert list(read_only_dir.iterdir()) == []


def test_cache_commands_leave_a_shared_directory_alone(tmp_path):
    shared = tmp_path / "tmp-like"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp: `cache stats --cache-dir /tmp` must not make it 0700
    env = {**os.environ, "MLX_KVSERVE_CACHE_DIR": str(shared)}
    for args, run_env in [(["--cache-dir", str(shared)], None), ([], env)]:
        command = [sys.executable, "-m", "mlx_kvserve", "cache", *args, "stats"]
        subprocess.run(command, check=True, capture_output=True, env=run_env)
        assert mode(shared) == 0o1777
    assert list(shared.iterdir()) == []  # a read-only command creates nothing


@pytest.mark.parametrize("shared_mode", [0o1777, 0o755, 0o775])
def test_existing_shared_directory_keeps_its_permissions(tmp_path, monkeypatch, shared_mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(shared_mode)
    monkeypatch.setenv("MLX_KVSERVE_DATA_DIR", str(shared))
    monkeypatch.setenv("MLX_KVSERVE_CACHE_DIR", str(shared))
    assert paths.data_dir() == shared and paths.cache_dir() == shared
    with PromptCache(shared, FP, disk_budget=2**20, ram_budget=0):  # what `serve` opens
        assert mode(shared) == shared_mode
        assert mode(shared / FP) == 0o700  # only what the server creates is private
    assert mode(shared) == shared_mode


def test_new_directories_are_private(tmp_path):
    root = tmp_path / "new" / "cache"
    with PromptCache(root, FP, disk_budget=2**20, ram_budget=0):
        assert mode(root) == 0o700 and mode(root / FP) == 0o700


def test_world_writable_without_sticky_bit_is_refused(tmp_path, caplog):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeCacheDirectory):
        private_subdir(open_dir, FP)
    assert not (open_dir / FP).exists()

    def open_cache(root):
        return PromptCache(root, FP, disk_budget=2**20, ram_budget=2**20)

    with caplog.at_level(logging.WARNING, logger="mlx_kvserve"):
        cache = open_or_degrade(open_cache, open_dir)
    try:
        assert cache.disk is None  # RAM only
        assert "not usable" in caplog.text
    finally:
        cache.close()


def test_foreign_or_symlinked_subdirectory_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (root / FP).symlink_to(target)
    with pytest.raises(UnsafeCacheDirectory):
        private_subdir(root, FP)
    if os.geteuid() != 0:
        return
    other = tmp_path / "other"
    other.mkdir()
    (other / FP).mkdir()
    os.chown(other / FP, 65534, 65534)  # pre-created by another user (nobody)
    with pytest.raises(UnsafeCacheDirectory):
        private_subdir(other, FP)
