"""Small state files (mlx_kvserve.durable): whole or absent, exactly private, no litter.

That they reach the drive with their directory is tested through the F_FULLFSYNC seam in
tests/unit/test_macos_paths.py."""

from __future__ import annotations

import os
import stat

import pytest

from mlx_kvserve import durable


def _temps(directory) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_create_file_first_writer_wins(tmp_path) -> None:
    path = tmp_path / "key"
    assert durable.create_file(path, b"first")
    assert not durable.create_file(path, b"second")
    assert path.read_bytes() == b"first" and not _temps(tmp_path)


def test_replace_file_replaces_whole(tmp_path) -> None:
    path = tmp_path / "unit"
    path.write_bytes(b"old and longer")
    durable.replace_file(path, b"new")
    assert path.read_bytes() == b"new" and not _temps(tmp_path)


@pytest.mark.parametrize("umask", [0, 0o077])
def test_the_mode_is_exact_whatever_the_umask(tmp_path, umask) -> None:
    old = os.umask(umask)
    try:
        durable.replace_file(tmp_path / "a", b"x", 0o600)
        durable.create_file(tmp_path / "b", b"x", 0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o644


def test_a_failed_replace_leaves_the_target_and_no_temporary(tmp_path) -> None:
    target = tmp_path / "in-the-way"
    target.mkdir()
    with pytest.raises(OSError):
        durable.replace_file(target, b"x")
    assert target.is_dir() and not _temps(tmp_path)
